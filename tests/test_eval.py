"""experiments/eval.py on models that the experiments trained and saved: quality, sizes, timings, bad input."""

import contextlib
import csv
import io
import json
import shutil
import subprocess
import sys
from unittest import mock

import pytest
from experiment_runs import EXPERIMENTS, QUICK, launch, needs_data, read_rows
from mpi_launch import check_ok

from training.results import EVAL_COLUMNS

pytestmark = [needs_data, pytest.mark.one_mpi]  # one_mpi: evaluation's logic, not the MPI library

# Every value eval.py and training print is rounded to 1e-5. The same samples' losses summed in another
# order (other batches, other ranks) differ by a few float32 ulps of a loss near 3 (2.4e-7 each): the
# rounded means may then differ by one last digit.
SAME_LOSS = 1.5e-5
# int8 rounds each weight by up to half a quantization step (max|w| / 254 per tensor: about 1% of a typical
# weight) and each batch's activations alike; bf16 keeps 8 significant bits (0.4%). That noise is zero-mean,
# so the mean loss over many tokens moves in second order, far less than 1%: a larger change means
# quantization or the cast went wrong (a wrong scale, a layer left out of the copy), not rounding.
QUANTIZED_LOSS_CHANGE = 0.01
EVAL_QUICK = ["--timing-seconds", "0.05", "--batch-size", "4"]


def save(tmp_path_factory, script: str, name: str):
    """Trains briefly on 2 ranks with --save-dir: (the model's directory, the training CSV's rows)."""
    out = tmp_path_factory.mktemp(name)
    trained = launch(script, 2, *QUICK, "--out-dir", out, "--save-dir", out / "model")
    check_ok(trained)
    return out / "model", read_rows(out)


@pytest.fixture(scope="module")
def gpt2_run(tmp_path_factory):
    return save(tmp_path_factory, "run_gpt2.py", "gpt2")


@pytest.fixture(scope="module")
def bert_run(tmp_path_factory):
    return save(tmp_path_factory, "run_bert.py", "bert")


def evaluate(model_dir, out_dir, nprocs: int, *args) -> list[dict]:
    result = launch("eval.py", nprocs, model_dir, "--out-dir", out_dir, *EVAL_QUICK, *args)
    check_ok(result)
    files = list(out_dir.glob("eval-*.csv"))
    assert len(files) == 1 and files[0].name.endswith(f"-n{nprocs}.csv"), files
    with open(files[0]) as f:
        assert next(csv.reader(f)) == EVAL_COLUMNS
    with open(files[0]) as f:
        return list(csv.DictReader(f))


def by_precision(rows, batch_size: int = 1) -> dict[str, dict]:
    return {row["precision"]: row for row in rows if int(row["batch_size"]) == batch_size}


def test_gpt2_quantized_and_bf16_keep_the_loss_and_shrink_as_expected(gpt2_run, tmp_path):
    model_dir, _ = gpt2_run
    rows = evaluate(model_dir, tmp_path, 1)
    assert sorted((r["precision"], int(r["batch_size"])) for r in rows) == sorted(
        (p, b) for p in ("fp32", "bf16", "int8") for b in (1, 4))
    rows = by_precision(rows)
    fp32 = float(rows["fp32"]["val_loss"])
    for precision in ("bf16", "int8"):
        assert abs(float(rows[precision]["val_loss"]) - fp32) <= QUANTIZED_LOSS_CHANGE * fp32, precision
    # Sizes from the architecture: gpt2-tiny on characters (vocabulary 65, context 64, width 64, 2 blocks).
    vocab, positions, width, blocks = 65, 64, 64, 2
    linear_shapes = [(width, 3 * width), (width, width), (width, 4 * width), (4 * width, width)]  # per block
    linear_weights = blocks * sum(fan_in * fan_out for fan_in, fan_out in linear_shapes)
    linear_biases = blocks * sum(fan_out for _, fan_out in linear_shapes)
    layer_norms = (2 * blocks + 1) * 2 * width
    parameters = vocab * width + positions * width + linear_weights + linear_biases + layer_norms
    assert int(rows["fp32"]["parameters"]) == parameters  # the lm_head is the embedding, counted once
    stored = parameters + (128 - vocab) * width  # in memory the vocabulary is padded to 128 rows
    mib = 2 ** 20  # the CSV rounds sizes to 1e-4 MiB
    assert float(rows["fp32"]["size_mb"]) == pytest.approx(4 * stored / mib, abs=1e-4)
    assert float(rows["bf16"]["size_mb"]) == pytest.approx(2 * stored / mib, abs=1e-4)
    # int8: the blocks' Linear weights take 1 byte instead of 4; the tied lm_head stays with the fp32 embedding.
    assert float(rows["int8"]["size_mb"]) == pytest.approx((4 * stored - 3 * linear_weights) / mib, abs=1e-4)


@pytest.mark.one_rank
def test_int8_stores_each_blocks_linear_weights_in_a_byte_and_keeps_the_tied_head():
    """eval.py's int8 form of a gpt2-tiny, in this process (the test above sees the same through a saved run):
    every Linear of the blocks (Conv1D made Linear) holds 1-byte weights, and the lm_head tied to the embedding
    stays the fp32 table. How little the loss moves is the test above's (QUANTIZED_LOSS_CHANGE)."""
    import eval
    import torch
    from fsdp_mpi_models.gpt2 import Conv1D, GPT2LMHeadModel, gpt2_config

    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny")).eval()
    linear_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, Conv1D))
    fp32_bytes = eval.weight_bytes(model)
    quantized = eval.quantized_int8(model)
    assert eval.weight_bytes(quantized) == fp32_bytes - 3 * linear_weights
    assert quantized.lm_head.weight is quantized.transformer.wte.weight
    with torch.no_grad():
        logits = quantized(torch.randint(0, model.config.vocab_size, (2, 32)))[0]
    assert logits.shape[:2] == (2, 32) and bool(logits.isfinite().all())


def test_timings_are_ordered_percentiles_of_enough_passes(gpt2_run, tmp_path):
    model_dir, _ = gpt2_run
    for row in evaluate(model_dir, tmp_path, 1, "--precisions", "fp32"):
        p50, p90, p99 = (float(row[f"latency_p{p}_ms"]) for p in (50, 90, 99))
        assert 0 < p50 <= p90 <= p99
        assert int(row["timed_passes"]) >= 10 and float(row["tokens_per_s"]) > 0


def test_eval_reproduces_the_validation_of_training_on_the_same_batches(gpt2_run, bert_run, tmp_path):
    """With training's batch size, steps and ranks, eval (loading the saved weights into shards) sees the very
    batches of training's last validation, BERT's masks and sentence pairs included: the same numbers."""
    for (model_dir, training_rows), name in ((gpt2_run, "gpt2"), (bert_run, "bert")):
        out = tmp_path / name
        rows = by_precision(evaluate(model_dir, out, 2, "--precisions", "fp32", "--val-steps", "2"))
        last = training_rows[-1]
        assert float(rows["fp32"]["val_loss"]) == pytest.approx(float(last["val_loss"]), abs=SAME_LOSS)
        if name == "bert":
            for column in ("val_mlm_accuracy", "val_nsp_accuracy"):
                assert float(rows["fp32"][column]) == pytest.approx(float(last[column]), abs=1e-5)
                assert 0 <= float(rows["fp32"][column]) <= 1


def test_two_ranks_evaluate_the_whole_split_as_one_process_does(gpt2_run, tmp_path):
    """fp32 sharded over 2 ranks and int8 replicated on both: each rank's share of the split, summed over ranks."""
    model_dir, _ = gpt2_run
    one = by_precision(evaluate(model_dir, tmp_path / "one", 1, "--precisions", "fp32,int8"))
    two = by_precision(evaluate(model_dir, tmp_path / "two", 2, "--precisions", "fp32,int8"))
    assert two["fp32"]["val_samples"] == one["fp32"]["val_samples"]
    assert float(two["fp32"]["val_loss"]) == pytest.approx(float(one["fp32"]["val_loss"]), abs=SAME_LOSS)
    # int8 quantizes each batch's activations with that batch's scale: other batches, other rounding.
    fp32 = float(one["fp32"]["val_loss"])
    assert abs(float(two["int8"]["val_loss"]) - float(one["int8"]["val_loss"])) <= QUANTIZED_LOSS_CHANGE * fp32
    assert two["int8"]["size_mb"] == one["int8"]["size_mb"] and two["fp32"]["size_mb"] == one["fp32"]["size_mb"]


def test_bert_reports_its_accuracies(bert_run, tmp_path):
    model_dir, _ = bert_run
    rows = by_precision(evaluate(model_dir, tmp_path, 1, "--precisions", "fp32,int8"))
    for row in rows.values():
        assert 0 <= float(row["val_mlm_accuracy"]) <= 1 and 0 <= float(row["val_nsp_accuracy"]) <= 1
        assert row["val_perplexity"] == ""
    assert float(rows["int8"]["size_mb"]) < float(rows["fp32"]["size_mb"])


def test_a_lightning_ddp_run_saves_a_model_that_eval_reads(tmp_path):
    trained = launch("run_gpt2.py", 2, *QUICK, "--strategy", "lightning-ddp", "--out-dir", tmp_path,
                     "--save-dir", tmp_path / "model")
    check_ok(trained)
    rows = by_precision(evaluate(tmp_path / "model", tmp_path / "eval", 2, "--precisions", "fp32", "--val-steps", "2"))
    assert rows["fp32"]["trained_strategy"] == "lightning-ddp"
    assert float(rows["fp32"]["val_loss"]) == pytest.approx(float(read_rows(tmp_path)[-1]["val_loss"]), abs=SAME_LOSS)


def test_compare_shows_evaluations_beside_training(gpt2_run, tmp_path):
    model_dir, _ = gpt2_run
    evaluate(model_dir, tmp_path, 1, "--precisions", "fp32,int8")
    csvs = [*model_dir.parent.glob("*.csv"), *tmp_path.glob("eval-*.csv")]
    assert len(csvs) == 3  # the training run's per-epoch and per-step CSVs, the evaluation's
    report = tmp_path / "report"
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "compare.py"), *map(str, csvs), "--out-dir", str(report)],
                            capture_output=True, text=True, timeout=120)
    check_ok(result)
    table = (report / "evaluation.md").read_text().splitlines()
    assert len(table) == 2 + 4 and all("| gpt2-tiny |" in line for line in table[2:])  # 2 precisions x 2 batches
    assert (report / "evaluation.png").stat().st_size > 0 and (report / "summary.md").is_file()


def fails_with(model_dir, out_dir, message: str, nprocs: int = 1, *args):
    """eval.py launched on `nprocs` ranks exits with status 2 and `message`, no traceback, and writes no CSV."""
    result = launch("eval.py", nprocs, model_dir, "--out-dir", out_dir, *EVAL_QUICK, *args, timeout=120)
    assert result.returncode == 2, (result.returncode, result.stderr)
    assert message in result.stderr and "Traceback" not in result.stderr, result.stderr
    assert not list(out_dir.glob("eval-*.csv"))


def fails_in_process_with(model_dir, out_dir, message: str, *args):
    """As fails_with on one rank, through eval.py's main() in this process (a one-rank test's child): the
    same checks without the 4 s a fresh interpreter takes to start. An exception would fail the test."""
    import eval

    stderr = io.StringIO()
    with mock.patch.object(sys, "argv", ["eval.py", str(model_dir), "--out-dir", str(out_dir), *EVAL_QUICK, *args]), \
            contextlib.redirect_stderr(stderr):
        try:
            status = eval.main()
        except SystemExit as exit_:  # argparse's refusals
            status = exit_.code
    assert status == 2 and message in stderr.getvalue(), (status, stderr.getvalue())
    assert not list(out_dir.glob("eval-*.csv"))


def damaged_copies(model_dir, tmp_path) -> dict:
    """Run directories that eval.py must refuse, each with the message it must give."""
    empty = tmp_path / "empty"
    empty.mkdir()
    broken = shutil.copytree(model_dir, tmp_path / "broken")
    (broken / "run.json").write_text("{not json")
    incomplete = shutil.copytree(model_dir, tmp_path / "incomplete")
    (incomplete / "model.safetensors").unlink()
    mismatched = shutil.copytree(model_dir, tmp_path / "mismatched")
    description = json.loads((mismatched / "run.json").read_text())
    description["options"]["model"] = "gpt2-seed"  # the weights are gpt2-tiny's
    (mismatched / "run.json").write_text(json.dumps(description))
    return {tmp_path / "nowhere": "no such directory", empty: "run.json is missing", broken: "not a run description",
            incomplete: "model.safetensors is missing", mismatched: "not those of the model run.json describes"}


@pytest.mark.one_rank
def test_missing_incomplete_or_mismatched_run_directories_exit_2(gpt2_run, tmp_path):
    model_dir, _ = gpt2_run
    for damaged, message in damaged_copies(model_dir, tmp_path).items():
        fails_in_process_with(damaged, tmp_path, message)
    fails_in_process_with(model_dir, tmp_path, "--precisions: unknown fp8", "--precisions", "fp32,fp8")


def test_a_refused_run_directory_ends_every_rank_with_status_2_and_no_traceback(gpt2_run, tmp_path):
    model_dir, _ = gpt2_run
    fails_with(tmp_path / "nowhere", tmp_path, "no such directory")
    mismatched = next(path for path in damaged_copies(model_dir, tmp_path) if path.name == "mismatched")
    fails_with(mismatched, tmp_path, "does not fit", 2)  # loading into shards finds it too, on every rank

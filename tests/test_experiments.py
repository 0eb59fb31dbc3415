"""The experiments end to end under mpiexec: CSV rows, the report, other strategies against fsdp-mpi, bad
input."""

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from experiment_runs import EXPERIMENTS, QUICK, SHARED_DATA, launch, needs_data, read_rows
from mpi_launch import check_ok, child_env, run_mpi

from training.results import COLUMNS, STEP_COLUMNS

# Two runs of the same training in another order of float32 sums: the CSV rounds each loss to 1e-5 (1e-5
# between them), and a loss near 4 moves by a few ulps (4.8e-7 each) per changed sum through QUICK's 6 steps.
SAME_TRAINING = 3e-5


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory):
    """Runs both experiments with fsdp-mpi and lightning-ddp on 2 ranks, once for all tests here."""
    root = tmp_path_factory.mktemp("results")
    for script in ("run_gpt2.py", "run_bert.py"):
        for strategy in ("fsdp-mpi", "lightning-ddp"):
            out = root / f"{script[:-3]}-{strategy}"
            result = launch(script, 2, *QUICK, "--strategy", strategy, "--out-dir", out)
            check_ok(result)
    return root


# (width, layers, positions) of the experiments' default models: gpt2-tiny and bert-tiny.
SHAPES = {"run_gpt2": (64, 2, 64), "run_bert": (128, 2, 512)}
# Cross-entropy of a uniform guess: GPT-2 over Tiny Shakespeare's 65 characters; BERT over its 30,522 WordPieces
# plus a coin flip for next-sentence prediction.
UNIFORM_LOSS = {"run_gpt2": math.log(65), "run_bert": math.log(30522) + math.log(2)}
# Below it after 3 small steps, but not below what a model without context can reach: the entropy of the
# token frequencies (Tiny Shakespeare's characters: 3.31 nats; Cornell's WordPieces: 5.39 nats).
CONTEXT_FREE_FLOOR = {"run_gpt2": 3.31, "run_bert": 5.39}


@needs_data
@pytest.mark.parametrize("script", ["run_gpt2", "run_bert"])
@pytest.mark.parametrize("strategy", ["fsdp-mpi", "lightning-ddp"])
def test_rows_have_every_column_and_values_that_agree_with_known_ones(results_dir, script, strategy):
    rows = read_rows(results_dir / f"{script}-{strategy}")
    width, layers, positions = SHAPES[script]
    assert [row["epoch"] for row in rows] == ["0", "1"]
    for row in rows:
        assert list(row) == COLUMNS
        assert row["strategy"] == strategy and row["world_size"] == "2" and row["device"] == "cpu"
        assert row["global_batch"] == "8" and row["seq_len"] == "32" and row["steps"] == "3"
        seconds, samples_per_s, tokens_per_s = (float(row[k]) for k in ("epoch_time_s", "samples_per_s", "tokens_per_s"))
        # 24 samples in the epoch, up to the CSV's rounding (epoch time to 1e-4 s, throughput to 1e-3/s).
        assert samples_per_s * seconds == pytest.approx(8 * 3, abs=samples_per_s * 5e-5 + seconds * 5e-4)
        assert tokens_per_s == pytest.approx(samples_per_s * 32, rel=1e-3)
        # FLOPs per token, written out here: 6 per weight (forward and backward) plus attention's 12 L C T.
        flops_per_token = 6 * (int(row["parameters"]) - positions * width) + 12 * layers * width * 32
        if script == "run_bert":  # whose masked-LM head (transform and vocabulary) runs at the 15% masked only
            flops_per_token -= 6 * 0.85 * (width * width + 30522 * width)
        assert float(row["tflops"]) == pytest.approx(tokens_per_s * flops_per_token / 1e12, rel=1e-3)
        assert 0 < float(row["mfu"]) < 1
        assert float(row["peak_rss_mb"]) > 50 and float(row["model_state_mb"]) > 0
        if script == "run_gpt2":
            assert float(row["val_perplexity"]) == pytest.approx(math.exp(float(row["val_loss"])), rel=1e-4)
            assert row["val_mlm_accuracy"] == ""
        else:
            assert 0 <= float(row["val_mlm_accuracy"]) <= 1 and 0 <= float(row["val_nsp_accuracy"]) <= 1
        if strategy == "fsdp-mpi":  # the busiest rank's communication plus everything else is the epoch
            comm, compute = float(row["comm_time_s"]), float(row["compute_time_s"])
            assert 0 < comm < seconds and comm + compute == pytest.approx(seconds, abs=2e-4)
        else:
            assert row["comm_time_s"] == row["compute_time_s"] == row["comm_mb_per_step"] == ""
    # One row per optimizer step; an epoch's loss is its steps' mean weighted by samples. Unrounded they agree to
    # float64 rounding; the CSV rounds each to 1e-5, moving the mean and the epoch's loss by up to 5e-6 each.
    steps = read_rows(results_dir / f"{script}-{strategy}", per="step")
    assert [(row["epoch"], row["step"]) for row in steps] == [("0", "1"), ("0", "2"), ("0", "3"),
                                                            ("1", "4"), ("1", "5"), ("1", "6")]
    for row in steps:
        assert list(row) == STEP_COLUMNS and row["run_id"] == rows[0]["run_id"] and row["samples"] == "8"
    for row in rows:
        in_epoch = [step for step in steps if step["epoch"] == row["epoch"]]
        mean = sum(float(step["train_loss"]) * 8 for step in in_epoch) / (8 * len(in_epoch))
        assert mean == pytest.approx(float(row["train_loss"]), abs=2 * 5e-6 + 1e-12)
    # Initial logits spread by about 0.02 * sqrt(width) add half their variance (< 0.05) to a uniform guess.
    first = float(rows[0]["train_loss"])
    assert CONTEXT_FREE_FLOOR[script] < first < UNIFORM_LOSS[script] + 0.05
    # Learning, seen on the same validation samples and masks after 3 and after 6 steps (the training loss is
    # over different samples each epoch: BERT's few masked tokens per sample make it too noisy to compare).
    assert float(rows[1]["val_loss"]) < float(rows[0]["val_loss"])


@needs_data
def test_lightning_and_fsdp_mpi_train_the_same_model_identically(results_dir):
    # BERT with its dropout too: drawn per sample, the masks are the same under both.
    for script in ("run_gpt2", "run_bert"):
        ours = read_rows(results_dir / f"{script}-fsdp-mpi")
        lightning = read_rows(results_dir / f"{script}-lightning-ddp")
        for a, b in zip(ours, lightning, strict=True):
            assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=1e-4), script
            assert float(a["val_loss"]) == pytest.approx(float(b["val_loss"]), rel=1e-4), script
    ours, lightning = (read_rows(results_dir / f"run_gpt2-{strategy}", per="step")
                       for strategy in ("fsdp-mpi", "lightning-ddp"))
    assert [a["step"] for a in ours] == [b["step"] for b in lightning] == [str(step) for step in range(1, 7)]
    for a, b in zip(ours, lightning):
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=1e-4)
    for script in ("run_gpt2", "run_bert"):
        ours_bytes = float(read_rows(results_dir / f"{script}-fsdp-mpi")[0]["model_state_mb"])
        assert ours_bytes < 0.6 * float(read_rows(results_dir / f"{script}-lightning-ddp")[0]["model_state_mb"])


@pytest.mark.one_mpi
@needs_data
@pytest.mark.parametrize("strategy,extra", [
    ("fsdp-mpi", []), ("fsdp-mpi", ["--accum-no-sync"]), ("ddp", []), ("torch-fsdp", ["--accum-no-sync"]),
    ("lightning-ddp", []), ("lightning-fsdp-mpi", []), ("lightning-fsdp-mpi", ["--accum-no-sync"]),
])
def test_two_accumulated_micro_batches_train_like_one_batch_of_twice_the_size(results_dir, tmp_path, strategy, extra):
    # QUICK's steps of 4 samples per rank, as 2 micro-batches of 2; twice the validation batches, so the same samples.
    result = launch("run_gpt2.py", 2, *QUICK, "--batch-size", "2", "--grad-accum", "2", "--val-steps", "4",
                    "--strategy", strategy, *extra, "--out-dir", tmp_path)
    check_ok(result)
    reference = read_rows(results_dir / "run_gpt2-fsdp-mpi")
    rows = read_rows(tmp_path)
    assert len(rows) == len(reference) == 2
    # Clipping at 1.0 acts on some steps, so a gradient of the wrong scale shows here (AdamW alone would hide it).
    for row, ref in zip(rows, reference):
        assert (row["global_batch"], row["grad_accum"], row["steps"]) == ("8", "2", "3")
        assert ref["grad_accum"] == "1"
        assert float(row["train_loss"]) == pytest.approx(float(ref["train_loss"]), abs=SAME_TRAINING)
        assert float(row["val_loss"]) == pytest.approx(float(ref["val_loss"]), abs=SAME_TRAINING)
    # Each optimizer step's loss too: its 2 micro-batches are counted as one step (Lightning's included).
    steps, reference_steps = read_rows(tmp_path, per="step"), read_rows(results_dir / "run_gpt2-fsdp-mpi", per="step")
    assert [(row["step"], row["samples"]) for row in steps] == [(str(step), "8") for step in range(1, 7)]
    for row, ref in zip(steps, reference_steps):
        assert float(row["train_loss"]) == pytest.approx(float(ref["train_loss"]), abs=SAME_TRAINING)


@pytest.mark.one_mpi
@needs_data
@pytest.mark.parametrize("strategy,extra", [("fsdp-mpi", ["--gradient-checkpointing"]),
                                            ("torch-fsdp", ["--backend", "fsdp_mpi"]), ("ddp", [])])
def test_other_strategies_and_recomputed_activations_train_like_fsdp_mpi(results_dir, tmp_path, strategy, extra):
    """torch's FSDP2 here on torch.distributed over fsdp_mpi (``--backend fsdp_mpi``), DDP on gloo (FSDP2 on
    gloo: the accumulation test above)."""
    result = launch("run_gpt2.py", 2, *QUICK, "--strategy", strategy, *extra, "--out-dir", tmp_path)
    check_ok(result)
    for row, ref in zip(read_rows(tmp_path), read_rows(results_dir / "run_gpt2-fsdp-mpi"), strict=True):
        assert row["strategy"] == strategy
        assert float(row["train_loss"]) == pytest.approx(float(ref["train_loss"]), abs=SAME_TRAINING)
        assert float(row["val_loss"]) == pytest.approx(float(ref["val_loss"]), abs=SAME_TRAINING)
    # Each optimizer step's loss too: its 2 micro-batches are counted as one step (Lightning's included).
    steps, reference_steps = read_rows(tmp_path, per="step"), read_rows(results_dir / "run_gpt2-fsdp-mpi", per="step")
    assert [(row["step"], row["samples"]) for row in steps] == [(str(step), "8") for step in range(1, 7)]
    for row, ref in zip(steps, reference_steps):
        assert float(row["train_loss"]) == pytest.approx(float(ref["train_loss"]), abs=SAME_TRAINING)


@pytest.mark.one_mpi
@needs_data
@pytest.mark.parametrize("strategy,precision", [
    ("fsdp-mpi", "bf16-mixed"), ("fsdp-mpi", "16-mixed"), ("ddp", "bf16-mixed"), ("ddp", "16-mixed"),
    ("torch-fsdp", "bf16-mixed"), ("lightning-ddp", "bf16-mixed"), ("lightning-fsdp-mpi", "bf16-mixed"),
])
def test_mixed_precision_trains_within_two_percent_of_fp32(results_dir, tmp_path, strategy, precision):
    result = launch("run_gpt2.py", 2, *QUICK, "--strategy", strategy, "--precision", precision, "--out-dir", tmp_path)
    check_ok(result)
    rows, reference = read_rows(tmp_path), read_rows(results_dir / "run_gpt2-fsdp-mpi")
    assert [row["precision"] for row in rows] == [precision] * 2 and reference[0]["precision"] == "32"
    assert float(rows[-1]["val_loss"]) == pytest.approx(float(reference[-1]["val_loss"]), rel=0.02)
    if strategy == "fsdp-mpi":
        # Bytes per step, from the parameter count P: the root unit (embeddings, final norm) is gathered once,
        # each of the L blocks (12 C^2 + 13 C parameters) twice, and every gradient reduced once in fp32.
        width, layers, _ = SHAPES["run_gpt2"]
        parameters = int(rows[0]["parameters"]) + (128 - 65) * width  # as moved: 65 characters padded to 128 rows
        blocks = layers * (12 * width**2 + 13 * width)
        flags = 4 * (4 + 12 * layers)  # one per parameter tensor (4 in the root, 12 per block): used anywhere?
        gathered = (parameters + blocks) * 2 + parameters * 4 + flags  # bf16 and fp16 gather 2 bytes per element
        fp32 = (parameters + blocks) * 4 + parameters * 4 + flags
        assert float(rows[0]["comm_mb_per_step"]) == pytest.approx(gathered / 2**20, abs=1e-4)
        assert float(reference[0]["comm_mb_per_step"]) == pytest.approx(fp32 / 2**20, abs=1e-4)


@pytest.mark.one_mpi
@needs_data
def test_compressed_communication_trains_like_fp32_in_fewer_bytes(results_dir, tmp_path):
    """int8 weights and bf16 gradients (--comm-compression int8/bf16): the same 2% of fp32's validation loss as
    16-bit compute (the per-step error bounds and the exact bytes are tests/test_compression.py's), and the
    bytes of a step: about 1 + 4/256 bytes per gathered element and 2 per reduced one, against 4 and 4, so
    about 0.34 of fp32's here; below 0.4 leaves room for each rank's last partial block of scales."""
    result = launch("run_gpt2.py", 2, *QUICK, "--comm-compression", "int8/bf16", "--out-dir", tmp_path)
    check_ok(result)
    rows, reference = read_rows(tmp_path), read_rows(results_dir / "run_gpt2-fsdp-mpi")
    assert [row["comm_compression"] for row in rows] == ["int8/bf16"] * 2 and reference[0]["comm_compression"] == "none"
    assert float(rows[-1]["val_loss"]) == pytest.approx(float(reference[-1]["val_loss"]), rel=0.02)
    assert float(rows[0]["comm_mb_per_step"]) < 0.4 * float(reference[0]["comm_mb_per_step"])


@pytest.mark.one_mpi
@needs_data
def test_an_offloaded_run_trains_as_the_same_run_not_offloaded_and_says_so(results_dir, tmp_path):
    """--cpu-offload: on a CPU the device is the host too, so the same steps to the bit (the path is the same,
    its copies free), a cpu_offload column that says it, and compare.py's own line for it beside fsdp-mpi's."""
    result = launch("run_gpt2.py", 2, *QUICK, "--cpu-offload", "--out-dir", tmp_path)
    check_ok(result)
    rows, reference = read_rows(tmp_path), read_rows(results_dir / "run_gpt2-fsdp-mpi")
    assert [row["cpu_offload"] for row in rows] == ["True"] * 2 and reference[0]["cpu_offload"] == "False"
    assert [row["train_loss"] for row in rows] == [row["train_loss"] for row in reference]
    compared = subprocess.run([sys.executable, str(EXPERIMENTS / "compare.py"), *map(str, tmp_path.glob("*.csv")),
                               *map(str, (results_dir / "run_gpt2-fsdp-mpi").glob("*.csv")), "--out-dir",
                               str(tmp_path / "compared")], capture_output=True, text=True, timeout=120)
    check_ok(compared)
    assert "fsdp-mpi+offload" in compared.stdout and "| fsdp-mpi |" in compared.stdout.replace("  ", " ")


@pytest.mark.one_mpi
@needs_data
def test_a_run_stepping_inside_backward_trains_as_the_same_run_stepping_after_and_says_so(tmp_path):
    """--step-in-backward (with accumulation, clipping off as it requires): the same losses to the bit as the
    same run stepping after backward, a step_in_backward column that says it, and compare.py's own line."""
    same = [*QUICK, "--clip-norm", "0", "--grad-accum", "2"]
    for name, extra in (("inside", ["--step-in-backward"]), ("after", [])):
        check_ok(launch("run_gpt2.py", 2, *same, *extra, "--out-dir", tmp_path / name))
    inside, after = read_rows(tmp_path / "inside"), read_rows(tmp_path / "after")
    assert [row["step_in_backward"] for row in inside] == ["True"] * 2 and after[0]["step_in_backward"] == "False"
    assert [(row["train_loss"], row["val_loss"]) for row in inside] == [(row["train_loss"], row["val_loss"])
                                                                         for row in after]
    compared = subprocess.run([sys.executable, str(EXPERIMENTS / "compare.py"), *map(str, tmp_path.glob("*/*.csv")),
                               "--out-dir", str(tmp_path / "compared")], capture_output=True, text=True, timeout=120)
    check_ok(compared)
    assert "fsdp-mpi+step_in_backward" in compared.stdout and "| fsdp-mpi |" in compared.stdout.replace("  ", " ")


@pytest.mark.one_mpi
@needs_data
def test_compare_makes_tables_and_plots(results_dir, tmp_path):
    csvs = sorted(str(p) for p in results_dir.glob("*/*.csv"))
    # the same configuration run on a GPU: a row of its own, never averaged with the CPU's
    cpu_run = next(Path(p) for p in csvs if "run_gpt2-fsdp-mpi/" in p and not p.endswith("-steps.csv"))
    with open(cpu_run) as f:
        rows = list(csv.DictReader(f))
    gpu_run = tmp_path / "gpu-run.csv"
    with open(gpu_run, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows({**row, "device": "cuda", "run_id": "gpu-" + row["run_id"],
                          "epoch_time_s": float(row["epoch_time_s"]) / 10} for row in rows)
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "compare.py"), *csvs, str(gpu_run),
                             "--out-dir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    check_ok(result)
    with open(tmp_path / "summary.csv") as f:
        summary = list(csv.DictReader(f))
    assert {(r["experiment"], r["strategy"], r["device"]) for r in summary} == {
        (e, s, "cpu") for e in ("gpt2", "bert") for s in ("fsdp-mpi", "lightning-ddp")} | {("gpt2", "fsdp-mpi", "cuda")}
    on = {r["device"]: float(r["epoch_time_s"]) for r in summary if (r["experiment"], r["strategy"]) == ("gpt2", "fsdp-mpi")}
    assert on["cuda"] == pytest.approx(on["cpu"] / 10)
    assert "| experiment | model | device | strategy | precision | world_size |" in (tmp_path / "summary.md").read_text()
    for name in ("epoch_time.png", "peak_memory.png", "loss_curves.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert any(path.endswith("-steps.csv") for path in csvs)  # the loss curves are per step


@pytest.mark.one_mpi
def test_compare_gives_rounds_their_median_spread_and_ratios_paired_by_round():
    """Runs named -r<N> are rounds: a line's time is the median of its runs with min-max, and fsdp_mpi_ratio pairs
    each round's fsdp-mpi run with this line's run of the same round, never a median with a median."""
    import pandas as pd

    import compare

    ours, theirs = [1.0, 2.0, 4.0], [4.0, 1.0, 2.0]  # per round: ratios 0.25, 2, 2 (the medians' ratio is 1)
    rows = pd.DataFrame([
        {"run_id": f"gpt2-{strategy}-n2-r{round_index + 1}", "experiment": "gpt2", "model": "gpt2-tiny",
         "device": "cpu", "strategy": strategy, "precision": "32", "world_size": 2, "parameters": 10, "epoch": epoch,
         "epoch_time_s": 99.0 if epoch == 0 else times[round_index], "samples_per_s": 8 / times[round_index],
         "tflops": 0.0, "mfu": 0.0, "comm_mb_per_step": 1.0, "peak_memory_mb": 5.0, "model_state_mb": 1.0,
         "train_loss": 1.0, "val_loss": 1.0, "val_perplexity": 2.7, "val_mlm_accuracy": None, "val_nsp_accuracy": None}
        for strategy, times in (("fsdp-mpi", ours), ("ddp", theirs)) for round_index in range(3)
        for epoch in range(2)])
    table = compare.summarize(rows).set_index("strategy")
    assert table.loc["fsdp-mpi", "epoch_time_s"] == 2.0  # the median of 1, 2, 4 (the first epochs left out)
    assert (table.loc["fsdp-mpi", "epoch_time_min"], table.loc["fsdp-mpi", "epoch_time_max"]) == (1.0, 4.0)
    assert table.loc["fsdp-mpi", "runs"] == 3
    ddp = table.loc["ddp"]
    assert (ddp["fsdp_mpi_ratio"], ddp["fsdp_mpi_ratio_min"], ddp["fsdp_mpi_ratio_max"]) == (2.0, 0.25, 2.0)
    # Without round names (or with one run each) there is nothing to pair, and no spread to show.
    single = compare.summarize(rows[rows["run_id"].str.endswith("-r1")].assign(
        run_id=lambda frame: frame["run_id"].str.removesuffix("-r1")))
    assert "fsdp_mpi_ratio" not in single and "epoch_time_min" not in single


@pytest.mark.one_mpi
def test_compare_rejects_bad_input(tmp_path):
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    for args, message in ((["missing.csv"], "no such file"), ([str(tmp_path / "other.csv")], "not a results CSV")):
        result = subprocess.run([sys.executable, str(EXPERIMENTS / "compare.py"), *args, "--out-dir", str(tmp_path)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


# Bad input to run_gpt2.py, and what the run must say (on stderr, exit 2, nothing written).
BAD_INPUTS = [
    (["--tokenizer", "gpt2", "--data-dir", "/nonexistent/data", "--no-download"],
     "missing data file /nonexistent/data/tokenizers/gpt2/vocab.json"),
    (["--model", "gpt3"], "invalid choice: 'gpt3'"),
    (["--strategy", "horovod"], "invalid choice: 'horovod'"),
    (["--strategy", "lightning-fsdp", "--device", "cpu"], "lightning-fsdp needs a GPU"),
    (["--seq-len", "4096"], "exceeds gpt2-tiny's context of 64"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
    (["--precision", "8"], "invalid choice: '8'"),
    (["--strategy", "lightning-ddp", "--precision", "16-mixed", "--device", "cpu"],
     "Lightning has no fp16 mixed precision on CPU"),
    (["--strategy", "lightning-fsdp-mpi", "--precision", "16-mixed"], "lightning-fsdp-mpi trains in 32 or bf16-mixed"),
    (["--comm-compression", "int4"], "expected WEIGHTS or WEIGHTS/GRADIENTS, each one of none, bf16, int8"),
    (["--strategy", "ddp", "--comm-compression", "int8"], "--comm-compression is fsdp_mpi's"),
    (["--strategy", "ddp", "--cpu-offload"], "--cpu-offload is fsdp_mpi's"),
    (["--strategy", "ddp", "--step-in-backward", "--clip-norm", "0"], "--step-in-backward is fsdp-mpi's"),
    (["--step-in-backward"], "--step-in-backward needs --clip-norm 0"),
    (["--step-in-backward", "--clip-norm", "0", "--precision", "16-mixed"], "--step-in-backward trains in 32 or bf16"),
    (["--step-in-backward", "--clip-norm", "0", "--keep-going", "--sharding-strategy", "NO_SHARD"],
     "--step-in-backward and --keep-going do not go together"),
    (["--backend", "gloo"], "--backend gloo is torch.distributed's, which fsdp-mpi does not use"),
    (["--grow-back"], "--grow-back puts the ranks back after a loss that --keep-going survives: give both"),
    (["--keep-going", "--checkpoint-dir", "unused"], "--keep-going under FULL_SHARD goes on from the latest "
     "checkpoint (no rank left holds the lost rank's shards): give it a --checkpoint-dir and --checkpoint-every N"),
]


@pytest.mark.one_mpi
@needs_data
def test_bad_input_fails_cleanly_without_a_csv(tmp_path):
    """Every case of BAD_INPUTS on 2 ranks: exit code 2 on both, the message and no traceback, no CSV. The first
    as a user launches it; all of them in one job (workers/bad_inputs.py runs the script's main per case: one
    start of MPI, Python and torch, not one per case)."""
    (args, message), out = BAD_INPUTS[0], tmp_path / "report.json"
    result = launch("run_gpt2.py", 2, *args, "--out-dir", tmp_path / "launched", timeout=120)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    cases = [[*args, "--out-dir", str(tmp_path / str(index))] for index, (args, _) in enumerate(BAD_INPUTS)]
    check_ok(run_mpi("bad_inputs.py", 2, out, "run_gpt2.py", json.dumps(cases), timeout=120,
                     env={"FSDP_MPI_DATA_DIR": str(SHARED_DATA)}))
    report = json.loads(out.read_text())
    assert len(report) == len(BAD_INPUTS)
    for case, (args, message) in zip(report, BAD_INPUTS):
        assert case["exit"] == 2 and message in case["stderr"] and "Traceback" not in case["stderr"], case
    assert not list(tmp_path.rglob("*.csv"))


# Imported first by every rank of a launch whose PYTHONPATH starts with its folder: torch then reports
# FAKE_CUDA_DEVICES visible GPUs (which it cannot use: a CPU build fails at the first tensor placed on one).
FAKE_GPUS = """import os

import torch

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: int(os.environ["FAKE_CUDA_DEVICES"])
"""


def fake_gpus(folder, count: int) -> dict:
    """The variables that make a launch's torch report `count` GPUs (FAKE_GPUS, written into `folder`)."""
    (folder / "sitecustomize.py").write_text(FAKE_GPUS)
    return {"PYTHONPATH": os.pathsep.join([str(folder), child_env()["PYTHONPATH"]]),
            "FAKE_CUDA_DEVICES": str(count)}


@pytest.mark.one_mpi
@needs_data
def test_a_run_on_gpus_gets_past_set_up_with_each_rank_on_its_node_local_gpu(tmp_path):
    """Issue 36: on a GPU, rank 0 used to compute its node-local rank (a collective) alone, inside the set-up
    it runs before the others, and the job hung silently. Now set-up ends, rank 0 names every rank's device,
    and the job fails promptly at its first CUDA call, which a CPU build of torch cannot make: selecting each
    rank's GPU (torch.cuda.set_device, before anything else touches CUDA)."""
    result = launch("run_gpt2.py", 2, *QUICK, "--device", "cuda", "--out-dir", tmp_path, timeout=90,
                    env={**fake_gpus(tmp_path, 2), "FSDP_MPI_TIMEOUT": "30"})
    assert "devices: rank 0 cuda:0, rank 1 cuda:1\n" in result.stdout, result.stdout + result.stderr
    assert result.returncode != 0 and "torch.cuda.set_device(device)" in result.stderr, result.stderr
    assert not list(tmp_path.glob("*.csv"))


@pytest.mark.one_mpi
@needs_data
def test_nccl_strategies_refuse_two_ranks_on_one_gpu(tmp_path):
    """torch's nccl cannot put two ranks on one GPU: the run says so in set-up instead of failing inside torch."""
    result = launch("run_gpt2.py", 2, *QUICK, "--device", "cuda", "--strategy", "ddp", "--out-dir", tmp_path,
                    timeout=90, env={**fake_gpus(tmp_path, 1), "FSDP_MPI_TIMEOUT": "30"})
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "ddp communicates through nccl, which cannot share a GPU between ranks: this node runs 2 ranks on 1 " \
           "visible GPU(s)" in result.stderr, result.stderr


@pytest.mark.one_mpi
@pytest.mark.parametrize("content,message", [(b"", "is empty"), ("caf\xe9".encode("latin-1"), "is not UTF-8 text")])
def test_unusable_text_fails_cleanly(tmp_path, content, message):
    (tmp_path / "data/tinyshakespeare").mkdir(parents=True)
    (tmp_path / "data/tinyshakespeare/input.txt").write_bytes(content)
    result = launch("run_gpt2.py", 2, "--data-dir", tmp_path / "data", "--out-dir", tmp_path, timeout=120)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.csv"))


@pytest.mark.one_mpi
@needs_data
def test_model_saved_from_two_ranks_samples_text(tmp_path):
    trained = launch("run_gpt2.py", 2, *QUICK, "--strategy", "fsdp-mpi", "--out-dir", tmp_path, "--save-dir", tmp_path / "model")
    check_ok(trained)
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "sample.py"), str(tmp_path / "model"),
                             "--prompt", "ROMEO:", "--max-new-tokens", "20"],
                            capture_output=True, text=True, timeout=120)
    check_ok(result)
    assert result.stdout.startswith("ROMEO:") and len(result.stdout.rstrip("\n")) == len("ROMEO:") + 20


@pytest.mark.one_mpi
def test_compare_figures_keep_the_longest_strategy_name_and_everything_else_inside(tmp_path, monkeypatch):
    """Legends beside the panels, long names wrapped, the figure as tall as its longest legend: every text lies
    inside the figure (its layout, not its pixels), and the panels keep most of the width."""
    import pandas as pd

    import compare
    from measuring import figures

    longest = "fsdp-mpi+forward_prefetch+backward_prefetch+async_reduce_scatter"
    strategies = [longest, "lightning-fsdp-mpi", "ddp", "torch-fsdp", "fsdp-mpi"]
    runs = pd.DataFrame([
        {"run_id": f"gpt2-{strategy}-n{n}-{i}{n}", "experiment": "gpt2", "model": "gpt2-tiny", "device": "cpu",
         "strategy": strategy, "precision": "bf16-mixed", "world_size": n, "epoch": epoch, "steps": 3,
         "train_loss": 4.0 - epoch, "val_loss": 4.1 - epoch, "epoch_time_s": 10.0 / n, "peak_memory_mb": 300.0 / n}
        for i, strategy in enumerate(strategies) for n in (1, 2) for epoch in range(2)])
    steps = pd.DataFrame([{"run_id": run_id, "step": step, "train_loss": 4.0 - step / 6}
                          for run_id in runs["run_id"].unique() for step in range(1, 7)])
    evaluation = pd.DataFrame([{"run_id": f"gpt2-{longest}-n2-abc123", "world_size": 2, "batch_size": 8,
                                "precision": precision, "size_mb": 1.0, "tokens_per_s": 100.0}
                               for precision in ("fp32", "bf16", "int8")])
    drawn = {}
    monkeypatch.setattr(figures, "save", lambda figure, path, dpi: drawn.setdefault(path.name, figure) and path)
    compare.plot_scaling(runs.groupby(compare.GROUP, as_index=False)[["epoch_time_s", "peak_memory_mb"]].mean(),
                         tmp_path)
    compare.plot_losses(runs, steps, tmp_path)
    compare.plot_evaluation(evaluation, tmp_path)
    assert sorted(drawn) == ["epoch_time.png", "evaluation.png", "loss_curves.png", "peak_memory.png"]
    for name, figure in drawn.items():
        assert figures.outside_the_figure(figure) == [], name
        widest = max(axis.get_window_extent().width for axis in figure.axes)
        assert widest > 0.4 * figure.bbox.width / len(figure.axes), name
        legends = [text.get_text().replace("\n", "") for axis in figure.axes if axis.get_legend()
                   for text in axis.get_legend().get_texts()]
        assert name == "evaluation.png" or any(longest in text for text in legends), (name, legends)

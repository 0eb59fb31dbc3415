"""The experiments end to end under mpiexec: CSV rows, the comparison report, and bad input."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_launch import REPO_ROOT, mpiexec

from results import COLUMNS

EXPERIMENTS = REPO_ROOT / "experiments"
SHARED_DATA = Path(os.environ.get("FSDP_MPI_DATA_DIR", REPO_ROOT.parent / "shared" / "data"))
pytestmark = pytest.mark.skipif(not (SHARED_DATA / "tinyshakespeare").is_dir(), reason=f"no shared data at {SHARED_DATA}")
QUICK = ["--epochs", "2", "--steps-per-epoch", "3", "--batch-size", "4", "--seq-len", "32", "--val-steps", "2",
         "--no-progress"]


def launch(script: str, nprocs: int, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", FSDP_MPI_DATA_DIR=str(SHARED_DATA), PYTHONUNBUFFERED="1")
    command = [mpiexec(), "-n", str(nprocs), sys.executable, str(EXPERIMENTS / script), *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def read_rows(out_dir: Path) -> list[dict]:
    files = list(out_dir.glob("*.csv"))
    assert len(files) == 1, files
    with open(files[0]) as f:
        return list(csv.DictReader(f))


@pytest.fixture(scope="module")
def results_dir(tmp_path_factory):
    """Runs both experiments with fsdp-mpi and lightning-ddp on 2 ranks, once for all tests here."""
    root = tmp_path_factory.mktemp("results")
    for script in ("run_gpt2.py", "run_bert.py"):
        for strategy in ("fsdp-mpi", "lightning-ddp"):
            out = root / f"{script[:-3]}-{strategy}"
            result = launch(script, 2, *QUICK, "--strategy", strategy, "--out-dir", out)
            assert result.returncode == 0, result.stderr[-3000:]
    return root


@pytest.mark.parametrize("script", ["run_gpt2", "run_bert"])
@pytest.mark.parametrize("strategy", ["fsdp-mpi", "lightning-ddp"])
def test_rows_have_every_column_and_plausible_values(results_dir, script, strategy):
    rows = read_rows(results_dir / f"{script}-{strategy}")
    assert [row["epoch"] for row in rows] == ["0", "1"]
    for row in rows:
        assert list(row) == COLUMNS
        assert row["strategy"] == strategy and row["world_size"] == "2" and row["device"] == "cpu"
        assert row["global_batch"] == "8" and row["seq_len"] == "32" and row["steps"] == "3"
        assert float(row["epoch_time_s"]) > 0 and float(row["samples_per_s"]) > 0
        assert float(row["tokens_per_s"]) == pytest.approx(float(row["samples_per_s"]) * 32, rel=1e-3)
        assert 0 < float(row["mfu"]) < 1 and float(row["tflops"]) > 0
        assert 0 < float(row["train_loss"]) < 20 and 0 < float(row["val_loss"]) < 20
        assert float(row["peak_rss_mb"]) > 50 and float(row["model_state_mb"]) > 0
        if script == "run_gpt2":
            assert float(row["val_perplexity"]) > 1 and row["val_mlm_accuracy"] == ""
        else:
            assert 0 <= float(row["val_mlm_accuracy"]) <= 1 and 0 <= float(row["val_nsp_accuracy"]) <= 1
        assert (row["comm_time_s"] != "") == (strategy == "fsdp-mpi")
    assert float(rows[1]["train_loss"]) < float(rows[0]["train_loss"])


def test_lightning_and_fsdp_mpi_train_the_same_model_identically(results_dir):
    # gpt2-tiny has no dropout, so both see the same numbers (BERT's dropout draws differ between them).
    ours = read_rows(results_dir / "run_gpt2-fsdp-mpi")
    lightning = read_rows(results_dir / "run_gpt2-lightning-ddp")
    for a, b in zip(ours, lightning):
        assert float(a["train_loss"]) == pytest.approx(float(b["train_loss"]), rel=1e-4)
        assert float(a["val_loss"]) == pytest.approx(float(b["val_loss"]), rel=1e-4)
    for script in ("run_gpt2", "run_bert"):
        ours_bytes = float(read_rows(results_dir / f"{script}-fsdp-mpi")[0]["model_state_mb"])
        assert ours_bytes < 0.6 * float(read_rows(results_dir / f"{script}-lightning-ddp")[0]["model_state_mb"])


def test_compare_makes_tables_and_plots(results_dir, tmp_path):
    csvs = sorted(str(p) for p in results_dir.glob("*/*.csv"))
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "compare.py"), *csvs, "--out-dir", str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    with open(tmp_path / "summary.csv") as f:
        summary = list(csv.DictReader(f))
    assert {(r["experiment"], r["strategy"]) for r in summary} == {
        (e, s) for e in ("gpt2", "bert") for s in ("fsdp-mpi", "lightning-ddp")}
    assert "| experiment | model | strategy | world_size |" in (tmp_path / "summary.md").read_text()
    for name in ("epoch_time.png", "peak_memory.png", "loss_curves.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_compare_rejects_bad_input(tmp_path):
    (tmp_path / "other.csv").write_text("a,b\n1,2\n")
    for args, message in ((["missing.csv"], "no such file"), ([str(tmp_path / "other.csv")], "not a results CSV")):
        result = subprocess.run([sys.executable, str(EXPERIMENTS / "compare.py"), *args, "--out-dir", str(tmp_path)],
                                capture_output=True, text=True, timeout=120)
        assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


@pytest.mark.parametrize("args,message", [
    (["--data-dir", "/nonexistent/data", "--no-download"], "missing data file /nonexistent/data/tinyshakespeare/input.txt"),
    (["--model", "gpt3"], "invalid choice: 'gpt3'"),
    (["--strategy", "horovod"], "invalid choice: 'horovod'"),
    (["--strategy", "lightning-fsdp"], "lightning-fsdp needs a GPU"),
    (["--seq-len", "4096"], "exceeds gpt2-tiny's context of 64"),
    (["--batch-size", "0"], "--batch-size must be at least 1"),
])
def test_bad_input_fails_cleanly_without_a_csv(tmp_path, args, message):
    result = launch("run_gpt2.py", 2, *args, "--out-dir", tmp_path, timeout=120)
    assert result.returncode != 0
    assert message in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.csv"))


@pytest.mark.parametrize("content,message", [(b"", "is empty"), ("caf\xe9".encode("latin-1"), "is not UTF-8 text")])
def test_unusable_text_fails_cleanly(tmp_path, content, message):
    (tmp_path / "data/tinyshakespeare").mkdir(parents=True)
    (tmp_path / "data/tinyshakespeare/input.txt").write_bytes(content)
    result = launch("run_gpt2.py", 2, "--data-dir", tmp_path / "data", "--out-dir", tmp_path, timeout=120)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.csv"))


def test_saved_model_samples_text(tmp_path):
    trained = launch("run_gpt2.py", 1, *QUICK, "--out-dir", tmp_path, "--save-dir", tmp_path / "model")
    assert trained.returncode == 0, trained.stderr
    result = subprocess.run([sys.executable, str(EXPERIMENTS / "sample.py"), str(tmp_path / "model"),
                             "--prompt", "ROMEO:", "--max-new-tokens", "20"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ROMEO:") and len(result.stdout.rstrip("\n")) == len("ROMEO:") + 20

"""The GPU lane (``python -m pytest -m gpu``): device code run for real, on 2 ranks sharing the machine's GPUs.

Every test here skips, saying so, where no CUDA device is visible. Whether one is, is asked of a child
process: pytest's own process must not initialise CUDA, since one-rank tests fork it (tests/conftest.py).
"""

import json
import subprocess
import sys

import pytest
from mpi_launch import check_ok, run_mpi


def _cuda_devices() -> int:
    asked = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=120)
    return int(asked.stdout.strip() or 0) if asked.returncode == 0 else 0


pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_cuda_devices() == 0, reason="needs a CUDA device")]


def test_collectives_on_the_gpu_through_the_node_and_staged(tmp_path):
    out = tmp_path / "gpu-collectives.json"
    check_ok(run_mpi("collectives.py", 2, out, "--device", "cuda", timeout=300))
    report = json.loads(out.read_text())
    # (7 collectives x 4 dtypes + 16-bit sums in fp32 x 2 + the route taken) x (node, staged) x (whole, 16-byte
    # chunks), + 64 MiB both ways
    assert len(report) == (7 * 4 + 2 + 1) * 2 * 2 + 1
    assert [name for name, ok in report.items() if not ok] == []


def test_run_gpt2_trains_on_the_gpu_on_two_ranks_sharing_it(tmp_path):
    """The main experiment as a GPU user runs it, with 2 ranks on the first GPU (bf16 mixed precision): it
    finishes, its CSV says cuda, and the loss falls from about ln 65 (a uniform guess over the characters)."""
    from test_experiments import QUICK, launch, read_rows

    on_the_gpu = [arg for arg in QUICK if arg not in ("--device", "cpu")] + ["--device", "cuda", "--precision",
                                                                              "bf16-mixed"]
    check_ok(launch("run_gpt2.py", 2, *on_the_gpu, "--out-dir", tmp_path, env={"CUDA_VISIBLE_DEVICES": "0"}))
    rows = read_rows(tmp_path)
    assert [row["device"] for row in rows] == ["cuda", "cuda"] and rows[0]["world_size"] == "2"
    steps = read_rows(tmp_path, per="step")
    assert float(steps[-1]["train_loss"]) < float(steps[0]["train_loss"]) <= 4.3

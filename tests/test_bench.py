"""bench.py runs the strategies side by side and reports ratios; oversized baselines are refused, not started."""

import csv
import subprocess
import sys

import pytest

from mpi_launch import REPO_ROOT

BENCH = REPO_ROOT / "experiments" / "bench.py"


def run_bench(*args, timeout=300):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout)


def test_bench_table_and_csv(tmp_path):
    out = tmp_path / "bench.csv"
    result = run_bench("--model", "gpt2-tiny", "--vocab-size", "128", "--batch-size", "2", "--seq-len", "16",
                       "--steps", "2", "--warmup", "1", "--out", str(out),
                       "--strategies",
                       "plain,fsdp-mpi@1,fsdp-mpi,fsdp-mpi+forward_prefetch+async_reduce_scatter,ddp,fsdp-mpi:bf16-mixed")
    assert result.returncode == 0, result.stderr
    assert "| strategy | precision | ranks | step_s | vs_fsdp_mpi |" in result.stdout
    with open(out) as f:
        all_rows = list(csv.DictReader(f))
    bf16 = next(r for r in all_rows if r["precision"] == "bf16-mixed")
    rows = {(r["strategy"], r["ranks"]): r for r in all_rows if r["precision"] == "32"}
    assert set(rows) == {("plain", "1"), ("fsdp-mpi", "1"), ("fsdp-mpi", "2"),
                         ("fsdp-mpi+forward_prefetch+async_reduce_scatter", "2"), ("ddp", "2")}
    # Bytes per step: gpt2-tiny with 128 tokens has P = 112,384 parameters, B = 99,968 of them in its 2 blocks;
    # the root is gathered once and each block twice (P + B elements), every gradient reduced once in fp32 (P).
    megabytes = {"32": (4 * (112_384 + 99_968) + 4 * 112_384) / 2**20,
                 "bf16-mixed": (2 * (112_384 + 99_968) + 4 * 112_384) / 2**20}
    assert float(rows[("fsdp-mpi", "2")]["comm_mb_per_step"]) == pytest.approx(megabytes["32"], rel=1e-9)
    assert float(bf16["comm_mb_per_step"]) == pytest.approx(megabytes["bf16-mixed"], rel=1e-9)
    assert float(rows[("fsdp-mpi", "2")]["vs_fsdp_mpi"]) == 1.0
    for row in rows.values():
        assert float(row["step_s"]) > 0 and float(row["tokens_per_s"]) > 0 and row["note"] == ""
    # sharding halves what each rank holds for parameters, gradients and Adam state (up to padding)
    ours, replicated = float(rows[("fsdp-mpi", "2")]["model_state_mb"]), float(rows[("ddp", "2")]["model_state_mb"])
    assert 0.5 <= ours / replicated < 0.51
    assert float(rows[("fsdp-mpi", "2")]["compute_s"]) == float(rows[("plain", "1")]["step_s"])


def test_replicated_model_too_big_for_this_machine_is_reported_not_run(tmp_path):
    result = run_bench("--model", "gpt2-xl", "--ranks", "64", "--strategies", "ddp", "--out", str(tmp_path / "b.csv"))
    assert result.returncode == 0, result.stderr
    assert "not run: model state needs" in result.stdout and "x 16 B x 1,557,611,200" in result.stdout


def test_bad_arguments():
    assert run_bench("--strategies", "horovod").returncode == 2
    assert "the rank count after @ must be a number" in run_bench("--strategies", "ddp@x").stderr
    assert "the precision after : must be one of" in run_bench("--strategies", "ddp:fp8").stderr
    assert "exceeds gpt2-tiny's context" in run_bench("--model", "gpt2-tiny", "--seq-len", "999").stderr

"""fsdp_mpi.lightning.FSDPMPIStrategy: a Lightning Trainer on 2 ranks matches plain torch in one process."""

import json

import pytest
import torch

from mpi_launch import check_ok, run_mpi

pytest.importorskip("lightning")

FP32_EPS = torch.finfo(torch.float32).eps


def test_lightning_trainer_with_fsdp_mpi_matches_one_process_resumes_and_mixes_precision(tmp_path):
    out = tmp_path / "report.json"
    check_ok(run_mpi("lightning_strategy.py", 2, out, tmp_path, timeout=300))
    report = json.loads(out.read_text())
    # 4 SGD steps (lr 0.1, momentum 0.9) on the same global batch. Each gradient is a sum over at most 16
    # samples of products over 8 inputs, so the 2 ranks' mean and one process's differ by at most 16 float32
    # roundings of the gradient norm; the momentum carries a step's gradient into later updates with total
    # weight below 1 + 1.9 + 2.71 + 3.44 < 10, and each of the 4 updates rounds the weight once.
    lr, eps = 0.1, FP32_EPS
    for run in ("unclipped", "clipped"):
        largest_gradient = max(report[f"{run}_gradient_norms"])
        bound = lr * 10 * 16 * eps * largest_gradient + 4 * eps * report[f"{run}_scale"]
        assert report[f"{run}_max_difference"] <= bound
    # Clipping at 0.05 acted on every step (the reference's norms before clipping are above it), and changed
    # the training: the unclipped reference's norms shrink as it fits, the clipped one's stay near the first.
    assert min(report["clipped_gradient_norms"]) > 0.05
    assert report["unclipped_gradient_norms"] != report["clipped_gradient_norms"]
    # Lightning's own collectives go through MPI: ranks hold 1.0 and 2.0.
    assert (report["reduce_sum"], report["reduce_mean"], report["all_gather"]) == (3.0, 1.5, [1.0, 2.0])
    assert report["broadcast"] == "from 1"
    # Resumed from the checkpoint after step 2 (shards, momentum, loops): bit for bit the run that went on.
    assert report["resumed_global_step"] == 4 and report["resumed_difference"] == 0.0
    # precision="bf16-mixed" becomes fsdp_mpi's MixedPrecision: blocks compute in bf16 over fp32 masters.
    assert report["precision_plugin"] == report["bf16_plugin"] == "FSDPMPIPrecision"
    assert report["bf16_compute_dtypes"] == ["torch.bfloat16"]
    assert report["bf16_master_dtypes"] == ["torch.float32"]

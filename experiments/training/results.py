"""The CSVs the experiments write: training's one row per epoch (one schema for all strategies) and one per
optimizer step (its loss curve), and eval.py's."""

import csv
import os
import resource
import socket
import subprocess
import time
from pathlib import Path

import torch

from training.choices import PRECISIONS

COLUMNS = [
    "run_id", "experiment", "strategy", "model", "parameters", "world_size", "threads_per_rank", "device", "precision",
    "comm_compression", "cpu_offload", "step_in_backward", "global_batch", "grad_accum", "seq_len", "epoch", "steps", "epoch_time_s", "samples_per_s", "tokens_per_s",
    "tflops", "mfu", "train_loss", "val_loss", "val_perplexity", "val_mlm_accuracy", "val_nsp_accuracy",
    "peak_memory_mb", "peak_rss_mb", "model_state_mb", "comm_time_s", "compute_time_s",
    "comm_mb_per_step", "git_commit", "timestamp",
]
# training's <run id>-steps.csv: one row per optimizer step; train_loss is the mean over the step's samples
STEP_COLUMNS = ["run_id", "experiment", "strategy", "model", "precision", "world_size", "epoch", "step", "samples",
                "train_loss"]
# eval.py: one row per precision and batch size of a saved model (precision: fp32, bf16, int8)
EVAL_COLUMNS = [
    "run_id", "experiment", "model", "parameters", "trained_strategy", "world_size", "threads_per_rank", "device",
    "precision", "size_mb", "val_samples", "val_loss", "val_perplexity", "val_mlm_accuracy", "val_nsp_accuracy",
    "batch_size", "seq_len", "latency_p50_ms", "latency_p90_ms", "latency_p99_ms", "tokens_per_s", "timed_passes",
    "git_commit", "timestamp",
]


def git_commit() -> str:
    try:
        output = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent, timeout=10)
        return output.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def peak_rss_mb() -> float:
    """This process's peak resident memory so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def resident_bytes() -> int:
    """This process's resident memory now (Linux's /proc; elsewhere its peak so far)."""
    try:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return int(peak_rss_mb() * 2**20)


def peak_resident_bytes() -> int:
    """The most this process has had resident since it started or since ``reset_peak_resident()``."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        return int(peak_rss_mb() * 2**20)


def reset_peak_resident() -> None:
    """Restarts the kernel's peak-resident counter at the present size (Linux >= 4.0; elsewhere nothing)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass


def model_state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes this rank holds for parameters, gradients and optimizer state (local shards only).

    Every trainable parameter counts one gradient of its size, whether or not it
    is allocated at the moment of measuring (strategies free them at different times).
    """
    def local(tensor):
        return tensor.to_local() if hasattr(tensor, "to_local") else tensor

    total = 0
    for param in model.parameters():
        total += local(param).numel() * param.element_size() * (2 if param.requires_grad else 1)
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                total += local(value).numel() * value.element_size()
    return total


# Published dense peaks (no sparsity) of the GPUs a GPU benchmark is likely to meet, in FLOP/s, by the name
# torch reports and the dtype the matrix multiplications run in (fp32 means TF32 off).
PUBLISHED_DENSE_PEAK_FLOPS = {
    ("H100", "bf16"): 989e12, ("H100", "fp16"): 989e12, ("H100", "tf32"): 494.7e12, ("H100", "fp32"): 67e12,  # SXM
    ("H200", "bf16"): 989e12, ("H200", "fp16"): 989e12, ("H200", "tf32"): 494.7e12, ("H200", "fp32"): 67e12,
    ("A100", "bf16"): 312e12, ("A100", "fp16"): 312e12, ("A100", "tf32"): 156e12, ("A100", "fp32"): 19.5e12,
}


def published_peak_flops(device: torch.device, compute_dtype: str) -> float | None:
    """The GPU's published dense peak for `compute_dtype` ("bf16", "fp16", "tf32", "fp32"), None if not in the table."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_properties(device).name
    return next((flops for (model, dtype), flops in PUBLISHED_DENSE_PEAK_FLOPS.items()
                 if model in name and dtype == compute_dtype), None)


def compute_dtype(precision: str) -> str:
    """The matrix products' dtype under `precision` (``choices.PRECISIONS``): fp32 ones run as tf32 where
    ``startup.allow_tf32`` let them."""
    dtype = PRECISIONS[precision]
    return "tf32" if dtype == "fp32" and torch.get_float32_matmul_precision() != "highest" else dtype


def job_peak_flops(comm, device: torch.device, precision: str) -> float:
    """MFU's denominator for the whole job (collective over `comm`, a ``Communicator``): every GPU in use once
    (ranks may share one) at its published dense peak for the compute dtype of `precision`, measured where the
    GPU is not listed; on the CPU, every rank's measured matrix product, all ranks at once (contention included).

    The measurement's matrices are not training's memory: the GPU's peak-memory counter starts again after it.
    """
    peak = published_peak_flops(device, compute_dtype(precision)) or measured_peak_flops(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    places = comm.all_gather_object((socket.gethostname(), str(device), peak))
    if device.type == "cuda":
        places = list({(host, gpu): (host, gpu, flops) for host, gpu, flops in places}.values())
    return sum(flops for _, _, flops in places)


def measured_peak_flops(device: torch.device) -> float:
    """FLOP/s of a large fp32 matrix multiplication on this rank, the best of several (the MFU denominator).

    Callers measure on every rank at once, so that the ranks share the machine as they will in training. On a
    CPU, 1024 x 1024 best of 7 finds the peak that 2048 x 2048 best of 3 found, in a quarter of the time (0.2 s
    against 0.8 s a rank here; every launch pays it): over 12 interleaved rounds the ratio's median was 1.007 to
    1.023, within the larger product's own spread from round to round (docs/testing.md).
    """
    size, repeats = (8192, 3) if device.type == "cuda" else (1024, 7)
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


class CsvWriter:
    """Writes rows to `<path>.partial` and renames it to `path` only when the run completes.

    A run that fails leaves no .csv behind, so nothing partial is ever read as a result.
    """

    def __init__(self, path: Path, columns: list[str] = COLUMNS):
        self.path, self.columns = path, columns
        self.partial = path.with_name(path.name + ".partial")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.partial, "w", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writeheader()

    def add(self, row: dict) -> None:
        unknown = set(row) - set(self.columns)
        if unknown:
            raise KeyError(f"not in the CSV schema: {sorted(unknown)}")
        with open(self.partial, "a", newline="") as f:
            csv.DictWriter(f, fieldnames=self.columns).writerow(row)

    def finish(self) -> Path:
        os.replace(self.partial, self.path)
        return self.path

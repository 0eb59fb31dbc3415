"""What both experiments share: command line, start-up checks, the training loop and the CSV rows.

An experiment supplies a *task* (``run_gpt2.GPT2Task``, ``run_bert.BertTask``):
its datasets (``train``, ``val``: ``len()`` and ``batch(indices, epoch)``),
``seq_len``, ``block_class`` (the wrap unit), ``model_name``, ``build_model()``,
``sample_losses(model, batch)`` (one loss per sample), ``eval_sums(model, batch)``
(sums to add over ranks), ``val_columns(sums)`` (the CSV's validation columns) and,
optionally, ``save_extras(directory)`` (files to keep beside a saved model).
"""

import argparse
import math
import sys
import time
import uuid
from contextlib import nullcontext
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import torch
from mpi4py import MPI

from data import DataError
from recipe import optimizer_and_schedule
from results import CsvWriter, git_commit, measured_peak_flops, model_state_bytes, peak_rss_mb
from sampling import global_batch_size, rank_batches, steps_per_epoch
from strategies import PRECISIONS, STRATEGIES, full_state_dict_on_rank0, local_rank, prepare

from fsdp_mpi import abort_job_on_uncaught_exception
from models.checkpoint import CheckpointError


class UsageError(Exception):
    """A combination of options that cannot run here."""


def argument_parser(description: str, model_choices, defaults: dict) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    add = parser.add_argument
    add("--model", default=defaults["model"], choices=model_choices, help="named model configuration")
    add("--strategy", default="fsdp-mpi", choices=STRATEGIES, help="who trains (default: %(default)s)")
    add("--epochs", type=int, default=defaults["epochs"])
    add("--steps-per-epoch", type=int, default=defaults["steps_per_epoch"], help="optimizer steps; 0: the whole epoch")
    add("--batch-size", type=int, default=defaults["batch_size"], help="samples per rank per micro-batch")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default: %(default)s)")
    add("--accum-no-sync", action="store_true",
        help="reduce gradients only on an optimizer step's last micro-batch (sharded strategies otherwise reduce each)")
    add("--seq-len", type=int, default=defaults["seq_len"])
    add("--precision", default="32", choices=list(PRECISIONS),
        help="32, or 16-bit compute over fp32 weights: bf16-mixed, 16-mixed (fp16, loss scaling) (default: %(default)s)")
    add("--lr", type=float, default=defaults["lr"], help="peak learning rate (default: %(default)s)")
    add("--warmup-steps", type=int, default=None,
        help="optimizer steps of linear warm-up (default: a tenth of the run's steps)")
    add("--weight-decay", type=float, default=0.1, help="AdamW's, on weights and embeddings (default: %(default)s)")
    add("--clip-norm", type=float, default=1.0, help="gradient-norm clipping threshold; 0: none (default: %(default)s)")
    add("--seed", type=int, default=0)
    add("--val-steps", type=int, default=10, help="validation batches per rank after each epoch")
    add("--threads", type=int, default=1, help="torch threads per rank")
    add("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: one GPU per rank if any")
    add("--data-dir", default=None, help="default: $FSDP_MPI_DATA_DIR, else ~/.cache/fsdp_mpi/data")
    add("--no-download", action="store_true", help="never fetch missing data files")
    add("--out-dir", default="results", help="where the CSV goes (default: %(default)s)")
    add("--run-id", default=None, help="default: experiment, strategy, ranks and a random suffix")
    add("--save-dir", default=None, help="save the trained model here (Hugging Face layout)")
    add("--no-progress", action="store_true", help="no progress bar")
    return parser


def check_arguments(args) -> None:
    for name in ("epochs", "batch_size", "grad_accum", "seq_len", "threads", "val_steps"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if args.steps_per_epoch < 0:
        raise UsageError("--steps-per-epoch must be 0 (whole epoch) or positive")
    if not args.lr > 0:
        raise UsageError("--lr must be positive")
    for name in ("warmup_steps", "weight_decay", "clip_norm"):
        if (getattr(args, name) or 0) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must not be negative")


def pick_device(choice: str, comm: MPI.Comm) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible")
        return torch.device("cuda", local_rank(comm) % torch.cuda.device_count())
    return torch.device("cpu")


def _set_up(task_type, args, comm: MPI.Comm):
    """(task, device, None) or (None, None, error message) for input this machine cannot run."""
    try:
        check_arguments(args)
        torch.set_num_threads(args.threads)
        device = pick_device(args.device, comm)
        if args.strategy == "lightning-fsdp" and device.type != "cuda":
            raise UsageError("lightning-fsdp needs a GPU (Lightning's FSDP does not run on CPU); "
                             "use fsdp-mpi, torch-fsdp or lightning-ddp here")
        if args.strategy.startswith("lightning") and args.precision == "16-mixed" and device.type != "cuda":
            raise UsageError("Lightning has no fp16 mixed precision on CPU (it would train in bf16-mixed "
                             "instead); use --precision bf16-mixed here")
        return task_type(args, comm), device, None
    except (DataError, UsageError, CheckpointError, ValueError) as failure:
        return None, None, str(failure)


def main(task_type, parser: argparse.ArgumentParser, experiment: str) -> int:
    """Runs one experiment under mpiexec; returns the exit code (2 for bad input, on every rank)."""
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    # Rank 0 sets up first (and downloads what is missing); the others follow only if it succeeded,
    # so every rank reports the same error instead of some waiting for a rank that failed.
    task = device = error = None
    if comm.Get_rank() == 0:
        task, device, error = _set_up(task_type, args, comm)
    error = comm.bcast(error, root=0)
    if error is None and comm.Get_rank() != 0:
        task, device, error = _set_up(task_type, args, comm)
    errors = [e for e in comm.allgather(error) if e]
    if errors:
        if comm.Get_rank() == 0:
            print(f"{parser.prog}: error: {errors[0]}", file=sys.stderr)
        return 2
    if comm.Get_size() > 1:
        abort_job_on_uncaught_exception(comm)
    if args.strategy.startswith("lightning"):
        from lightning_runner import train_with_lightning

        path = train_with_lightning(task, args, comm, device, experiment)
    else:
        path = train(task, args, comm, device, experiment)
    if comm.Get_rank() == 0:
        print(f"wrote {path}")
    return 0


class RunRecorder:
    """Turns one epoch's measurements into a CSV row (rank 0 writes)."""

    def __init__(self, task, args, comm: MPI.Comm, device: torch.device, experiment: str, model):
        self.comm, self.task, self.args = comm, task, args
        world = comm.Get_size()
        self.run_id = args.run_id or f"{experiment}-{args.strategy}-n{world}-{uuid.uuid4().hex[:6]}"
        self.flops_per_token = model.training_flops_per_token(task.seq_len)
        comm.Barrier()
        self.peak_flops = comm.allreduce(measured_peak_flops(device), op=MPI.SUM)
        self.fixed = {
            "run_id": self.run_id, "experiment": experiment, "strategy": args.strategy, "model": task.model_name,
            "parameters": model.num_parameters(), "world_size": world, "threads_per_rank": args.threads,
            "device": device.type, "precision": args.precision, "global_batch": args.batch_size * world * args.grad_accum,
            "grad_accum": args.grad_accum, "seq_len": task.seq_len, "git_commit": git_commit(),
        }
        self.writer = None
        if comm.Get_rank() == 0:
            self.writer = CsvWriter(Path(args.out_dir) / f"{self.run_id}.csv")

    def add_epoch(self, epoch: int, steps: int, samples: int, seconds: float, train_loss: float, val: dict,
                  state_bytes: int, comm_seconds: float, device: torch.device, comm_mb_per_step: float = 0.0) -> None:
        peak_memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        per_rank = self.comm.allgather([peak_rss_mb(), state_bytes / 2**20, (peak_memory or 0) / 2**20, comm_seconds])
        maxima = [max(column) for column in zip(*per_rank)]  # the busiest rank
        tokens_per_s = samples * self.task.seq_len / seconds
        achieved = tokens_per_s * self.flops_per_token
        row = {
            **self.fixed, "epoch": epoch, "steps": steps, "epoch_time_s": round(seconds, 4),
            "samples_per_s": round(samples / seconds, 3), "tokens_per_s": round(tokens_per_s, 1),
            "tflops": round(achieved / 1e12, 6), "mfu": round(achieved / self.peak_flops, 5),
            "train_loss": round(train_loss, 5), **val,
            "peak_memory_mb": round(maxima[2] if device.type == "cuda" else maxima[0], 1),
            "peak_rss_mb": round(maxima[0], 1), "model_state_mb": round(maxima[1], 3),
            "comm_time_s": "" if math.isnan(maxima[3]) else round(maxima[3], 4),
            "comm_mb_per_step": round(comm_mb_per_step, 4) if comm_mb_per_step else "",
            "compute_time_s": "" if math.isnan(maxima[3]) else round(seconds - maxima[3], 4),
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        if self.writer:
            self.writer.add(row)

    def finish(self) -> Path | None:
        return self.writer.finish() if self.writer else None


def build_model(task, args, comm: MPI.Comm):
    """The same initial weights on every rank, then a different random stream per rank (dropout)."""
    torch.manual_seed(args.seed)
    model = task.build_model()
    torch.manual_seed(args.seed * 1000 + 1 + comm.Get_rank())
    return model


def to_device(batch, device: torch.device):
    return tuple(t.to(device) for t in batch)


class MicroBatch(NamedTuple):
    """One forward and backward on this rank, part of an optimizer step."""

    indices: torch.Tensor  # this rank's samples (a stand-in when it has none)
    weight: float  # on this rank's loss sum: world size / samples in the whole optimizer step (0: stand-in)
    samples: int  # samples in this micro-batch over all ranks


def epoch_steps(num_samples: int, args, comm: MPI.Comm, epoch: int, seed: int) -> list[list[MicroBatch]]:
    """This rank's optimizer steps in one epoch, each a list of up to `args.grad_accum` micro-batches.

    The micro-batches of a step together hold the samples that one batch of
    ``batch_size * grad_accum`` would, and each rank's loss sum is weighted by
    world size over the step's global sample count, so that the averaged,
    accumulated gradient is the mean over the step's samples, also in the short
    steps at the end of an epoch. An empty share trains on a stand-in with weight 0,
    because every rank must still take part in the step's collectives.
    """
    world = comm.Get_size()
    batches = rank_batches(num_samples, args.batch_size, comm.Get_rank(), world, seed, epoch)
    steps = []
    for first in range(0, len(batches), args.grad_accum)[:args.steps_per_epoch or None]:
        micro = range(first, min(first + args.grad_accum, len(batches)))
        sizes = [global_batch_size(num_samples, args.batch_size, world, m) for m in micro]
        step_total = sum(sizes)
        steps.append([MicroBatch(batches[m], world / step_total, size) if len(batches[m])
                      else MicroBatch(torch.zeros(1, dtype=torch.long), 0.0, size) for m, size in zip(micro, sizes)])
    return steps


def total_optimizer_steps(num_samples: int, args, world: int) -> int:
    """Optimizer steps in the whole run (the learning-rate schedule's length); the same on every rank."""
    per_epoch = -(-steps_per_epoch(num_samples, args.batch_size, world) // args.grad_accum)
    return args.epochs * min(per_epoch, args.steps_per_epoch or per_epoch)


@torch.no_grad()
def evaluate(task, model, args, comm: MPI.Comm, device: torch.device, autocast=nullcontext) -> dict:
    """The validation columns, from `--val-steps` batches per rank (the same ones every epoch), under `autocast`."""
    model.eval()
    totals: dict[str, float] = {}
    batches = argparse.Namespace(batch_size=args.batch_size, grad_accum=1, steps_per_epoch=args.val_steps)
    for (micro,) in epoch_steps(len(task.val), batches, comm, epoch=0, seed=args.seed + 1):
        with autocast():
            sums = task.eval_sums(model, to_device(task.val.batch(micro.indices, 0), device))
        for key, value in sums.items():
            totals[key] = totals.get(key, 0.0) + (value if micro.weight else 0.0)
    model.train()
    keys = sorted(totals)
    summed = comm.allreduce([totals[k] for k in keys], op=MPI.SUM)
    return task.val_columns(dict(zip(keys, summed)))


def optimizer_step(task, prepared, optimizer, schedule, step: list[MicroBatch], args, epoch: int,
                   device: torch.device) -> tuple[float, torch.Tensor]:
    """Accumulates the gradients of `step`'s micro-batches, clips them and updates the weights.

    Gradients are reduced on the last micro-batch, and on every one under a sharded
    strategy (which keeps gradient memory at 1/N) unless --accum-no-sync says otherwise.
    Under 16-mixed the loss is scaled, and a step whose gradients overflowed is skipped
    on every rank. Returns this rank's loss sum and its last micro-batch's per-sample losses.
    """
    loss_sum, losses, scaler = 0.0, None, prepared.scaler
    for position, micro in enumerate(step):
        defer_sync = position < len(step) - 1 and (args.accum_no_sync or not prepared.shards_gradients)
        with prepared.no_sync() if defer_sync else nullcontext():
            with prepared.autocast():
                losses = task.sample_losses(prepared.model, to_device(task.train.batch(micro.indices, epoch), device))
            scaler.scale(losses.sum() * micro.weight).backward()
        loss_sum += losses.sum().item() if micro.weight else 0.0
    if args.clip_norm:
        scaler.unscale_(optimizer)
        prepared.clip_grad_norm(args.clip_norm)
    scaler.step(optimizer)
    scaler.update()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, losses


def train(task, args, comm: MPI.Comm, device: torch.device, experiment: str) -> Path | None:
    """The training loop for fsdp-mpi, ddp and torch-fsdp."""
    from tqdm import tqdm

    model = build_model(task, args, comm)
    recorder = RunRecorder(task, args, comm, device, experiment, model)
    prepared = prepare(args.strategy, model, task.block_class, device, comm, args.precision)
    optimizer, schedule = optimizer_and_schedule(prepared.model, args,
                                                 total_optimizer_steps(len(task.train), args, comm.Get_size()))
    for epoch in range(args.epochs):
        steps = epoch_steps(len(task.train), args, comm, epoch, args.seed)
        progress = tqdm(steps, desc=f"epoch {epoch}", disable=args.no_progress or comm.Get_rank() != 0,
                        file=sys.stdout, dynamic_ncols=True)
        loss_sum, samples = 0.0, 0
        comm.Barrier()
        comm_before, bytes_before, start = prepared.comm_seconds(), prepared.comm_bytes(), time.perf_counter()
        for step in progress:
            step_loss, losses = optimizer_step(task, prepared, optimizer, schedule, step, args, epoch, device)
            loss_sum += step_loss
            samples += sum(micro.samples for micro in step)
            if comm.Get_rank() == 0:
                progress.set_postfix(loss=f"{losses.mean().item():.3f}")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        comm.Barrier()
        seconds = time.perf_counter() - start
        comm_seconds = prepared.comm_seconds() - comm_before
        comm_mb_per_step = (prepared.comm_bytes() - bytes_before) / len(steps) / 2**20
        train_loss = comm.allreduce(loss_sum, op=MPI.SUM) / samples
        val = evaluate(task, prepared.model, args, comm, device, prepared.autocast)
        if comm.Get_rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}, " + ", ".join(f"{k} {v}" for k, v in val.items())
                  + f", {seconds:.1f} s", flush=True)
        recorder.add_epoch(epoch, len(steps), samples, seconds, train_loss, val,
                           model_state_bytes(prepared.model, optimizer), comm_seconds, device, comm_mb_per_step)
    if args.save_dir:
        save_trained(task, full_state_dict_on_rank0(args.strategy, prepared.model, comm), Path(args.save_dir))
    return recorder.finish()


def save_trained(task, state: dict | None, directory: Path) -> None:
    """Rank 0 writes the trained weights in Hugging Face's layout, plus the task's extras."""
    if state is None:
        return
    model = task.build_model()
    model.load_state_dict(state)
    model.save_pretrained(directory)
    if hasattr(task, "save_extras"):
        task.save_extras(directory)

"""What both experiments share: start-up, the training loop and the CSV rows (the command line is ``options``).

An experiment supplies a *task* (``run_gpt2.GPT2Task``, ``run_bert.BertTask``):
its datasets (``train``, ``val``: ``len()`` and ``batch(indices, epoch)``),
``seq_len``, ``block_class`` (the wrap unit), ``model_name``, ``build_model()``,
``sample_losses(model, batch)`` (one loss per sample), ``eval_sums(model, batch)``
(sums to add over ranks), ``val_columns(sums)`` (the CSV's validation columns) and,
optionally, ``save_extras(directory)`` (files to keep beside a saved model) and
``training_flops_per_token(model)`` (when it runs less of the model than all of it).

The loop stops between optimizer steps on SIGTERM or SIGUSR1 and, under fsdp-mpi,
checkpoints and resumes bit for bit; what a checkpoint holds is in ``resume``.
"""

import argparse
import math
import signal
import sys
import time
import uuid
from contextlib import nullcontext
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import NamedTuple

import numpy
import torch
from mpi4py import MPI

from data import DataError
from options import Batching, RunConfig, UsageError, check_checkpoint_options, check_config
from recipe import optimizer_and_schedule
from results import STEP_COLUMNS, CsvWriter, git_commit, measured_peak_flops, model_state_bytes, peak_rss_mb
from resume import EpochTally, Position, ResumeError, RunCheckpoints, StopSignals, Stopped
from saved_run import write_run_file
from sampling import global_batch_size, rank_batches, steps_per_epoch
from strategies import Prepared, full_state_dict_on_rank0, local_rank, prepare

from fsdp_mpi import CheckpointError as ShardedCheckpointError
from fsdp_mpi import abort_job_on_uncaught_exception
from fsdp_mpi.launcher import LauncherMismatchError, check_launcher_agrees
from models.checkpoint import CheckpointError


def pick_device(choice: str, comm: MPI.Comm) -> torch.device:
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible")
        return torch.device("cuda", local_rank(comm) % torch.cuda.device_count())
    return torch.device("cpu")


def _set_up(task_type, config: RunConfig, comm: MPI.Comm):
    """(task, device, None) or (None, None, error message) for input this machine cannot run."""
    try:
        check_config(config)
        torch.set_num_threads(config.threads)
        device = pick_device(config.device, comm)
        if config.strategy == "lightning-fsdp" and device.type != "cuda":
            raise UsageError("lightning-fsdp needs a GPU (Lightning's FSDP does not run on CPU); "
                             "use fsdp-mpi, torch-fsdp or lightning-ddp here")
        if config.strategy == "lightning-fsdp" and config.save_dir:
            raise UsageError("--save-dir is not supported with lightning-fsdp (its weights stay sharded in "
                             "Lightning's layout); train with fsdp-mpi or torch-fsdp to save the model")
        if config.strategy == "lightning-fsdp-mpi" and config.precision == "16-mixed":
            raise UsageError("lightning-fsdp-mpi trains in 32 or bf16-mixed (fp16 loss scaling is not wired into "
                             "its Lightning strategy); fsdp-mpi itself has 16-mixed")
        if config.strategy.startswith("lightning") and config.precision == "16-mixed" and device.type != "cuda":
            raise UsageError("Lightning has no fp16 mixed precision on CPU (it would train in bf16-mixed "
                             "instead); use --precision bf16-mixed here")
        return task_type(config, comm), device, None
    except (DataError, UsageError, CheckpointError, ValueError) as failure:
        return None, None, str(failure)


def main(task_type, config_type: type[RunConfig], parser: argparse.ArgumentParser, experiment: str) -> int:
    """Runs one experiment under mpiexec; returns the exit code, the same on every rank.

    `task_type` is built from the `config_type` (RunConfig or an experiment's subclass) that `parser` gives.

    2: bad input or an unusable checkpoint; resume.STOPPED_WITH_CHECKPOINT (3) and
    STOPPED_WITHOUT_CHECKPOINT (4): stopped by SIGTERM or SIGUSR1 between two optimizer steps.
    """
    options = parser.parse_args()
    check_checkpoint_options(parser, options)
    config = config_type.from_namespace(options)
    comm = MPI.COMM_WORLD
    try:  # before anything is written: N one-rank worlds would each write a run of their own
        check_launcher_agrees(comm.Get_size())
    except LauncherMismatchError as mismatch:
        print(f"{parser.prog}: error: {mismatch}", file=sys.stderr)
        return 2
    stop = listen_for_stop_signals(config.strategy)
    values, error = set_up_rank_0_first(lambda: _set_up(task_type, config, comm), comm)
    if error:
        if comm.Get_rank() == 0:
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    task, device = values
    if comm.Get_size() > 1:
        abort_job_on_uncaught_exception(comm)
    stopped = None
    if config.strategy.startswith("lightning"):
        from lightning_runner import train_with_lightning

        path = train_with_lightning(task, config, comm, device, experiment)
    else:
        try:
            path, stopped = train(task, config, comm, device, experiment, stop)
        except (ShardedCheckpointError, ResumeError) as failure:  # raised on every rank alike
            if comm.Get_rank() == 0:
                print(f"{parser.prog}: error: {failure}", file=sys.stderr)
            return 2
    if comm.Get_rank() == 0:
        print(f"wrote {path}" + (" (the epochs completed so far)" if stopped else ""))
        if stopped:
            print(stopped.message(), flush=True)
    return stopped.exit_code if stopped else 0


def set_up_rank_0_first(set_up, comm: MPI.Comm) -> tuple[list | None, str | None]:
    """Runs ``set_up()`` (which returns its values and, last, an error message or None) on rank 0 first,
    which may download what is missing, then on the others only if it succeeded: every rank gets the
    same first error instead of some waiting for a rank that failed. Returns (the values, that error)."""
    values = error = None
    if comm.Get_rank() == 0:
        *values, error = set_up()
    error = comm.bcast(error, root=0)
    if error is None and comm.Get_rank() != 0:
        *values, error = set_up()
    errors = [e for e in comm.allgather(error) if e]
    return values, (errors[0] if errors else None)


def listen_for_stop_signals(strategy: str) -> StopSignals:
    """Our training loop stops between optimizer steps on SIGTERM or SIGUSR1.

    Lightning's loop cannot: there SIGUSR1 (the hpc/ scripts' warning before the time
    limit) is ignored, so that the run goes on until the limit, and SIGTERM ends it as usual.
    """
    if strategy.startswith("lightning"):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        return StopSignals()
    return StopSignals().install()


class RunRecorder:
    """Turns one epoch's tally into its CSV row and its steps' rows (rank 0 writes), and keeps them for checkpoints.

    ``<out dir>/<run id>.csv`` gets a row per epoch, ``<run id>-steps.csv`` a row per optimizer step.
    """

    def __init__(self, task, config: RunConfig, comm: MPI.Comm, device: torch.device, experiment: str, model):
        self.comm, self.task, self.config = comm, task, config
        world = comm.Get_size()
        self.run_id = config.run_id or f"{experiment}-{config.strategy}-n{world}-{uuid.uuid4().hex[:6]}"
        task_flops = getattr(task, "training_flops_per_token", None)  # a task that skips some of the model's work
        self.flops_per_token = task_flops(model) if task_flops else model.training_flops_per_token(task.seq_len)
        comm.Barrier()
        self.peak_flops = comm.allreduce(measured_peak_flops(device), op=MPI.SUM)
        self.fixed = {
            "run_id": self.run_id, "experiment": experiment, "strategy": config.strategy, "model": task.model_name,
            "parameters": model.num_parameters(), "world_size": world, "threads_per_rank": config.threads,
            "device": device.type, "precision": config.precision,
            "global_batch": config.batch_size * world * config.grad_accum,
            "grad_accum": config.grad_accum, "seq_len": task.seq_len, "git_commit": git_commit(),
        }
        self.rows: list[dict] = []
        self.step_rows: list[dict] = []
        self.writers = None  # rank 0's (epochs, steps), opened at the first row: a resumed run takes its run id before

    def add_epoch(self, epoch: int, first_step: int, tally: EpochTally, val: dict, state_bytes: int,
                  device: torch.device) -> None:
        """Every rank calls it after validating; rank 0 prints the epoch's line and writes its rows.

        `first_step`: the run's optimizer steps before this epoch. `tally.comm_seconds` is NaN where unmeasured.
        """
        step_loss_sums = numpy.array(tally.step_loss_sums, dtype=numpy.float64)  # (steps,) this rank's, then all's
        self.comm.Allreduce(MPI.IN_PLACE, step_loss_sums, op=MPI.SUM)
        samples, seconds = sum(tally.step_samples), tally.seconds
        train_loss = float(step_loss_sums.sum()) / samples  # a Python float: rows go into checkpoints
        peak_memory = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        per_rank = self.comm.allgather([peak_rss_mb(), state_bytes / 2**20, (peak_memory or 0) / 2**20,
                                        tally.comm_seconds])
        maxima = [max(column) for column in zip(*per_rank)]  # the busiest rank
        tokens_per_s = samples * self.task.seq_len / seconds
        achieved = tokens_per_s * self.flops_per_token
        row = {
            **self.fixed, "epoch": epoch, "steps": tally.steps, "epoch_time_s": round(seconds, 4),
            "samples_per_s": round(samples / seconds, 3), "tokens_per_s": round(tokens_per_s, 1),
            "tflops": round(achieved / 1e12, 6), "mfu": round(achieved / self.peak_flops, 5),
            "train_loss": round(train_loss, 5), **val,
            "peak_memory_mb": round(maxima[2] if device.type == "cuda" else maxima[0], 1),
            "peak_rss_mb": round(maxima[0], 1), "model_state_mb": round(maxima[1], 3),
            "comm_time_s": "" if math.isnan(maxima[3]) else round(maxima[3], 4),
            "comm_mb_per_step": round(tally.comm_bytes / tally.steps / 2**20, 4) if tally.comm_bytes else "",
            "compute_time_s": "" if math.isnan(maxima[3]) else round(seconds - maxima[3], 4),
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        step_rows = [{name: row[name] for name in STEP_COLUMNS if name in self.fixed}
                     | {"epoch": epoch, "step": first_step + index + 1, "samples": count,
                        "train_loss": round(loss / count, 5)}
                     for index, (loss, count) in enumerate(zip(step_loss_sums.tolist(), tally.step_samples))]
        if self.comm.Get_rank() == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}, " + ", ".join(f"{k} {v}" for k, v in val.items())
                  + f", {seconds:.1f} s", flush=True)
            epochs_csv, steps_csv = self._writers()
            epochs_csv.add(row)
            for step_row in step_rows:
                steps_csv.add(step_row)
        self.rows.append(row)
        self.step_rows += step_rows

    def resume(self, run_id: str, rows: list[dict], step_rows: list[dict]) -> None:
        """Continues a stopped run's CSVs: its run id, and its rows so far ahead of the new ones."""
        self.run_id = self.fixed["run_id"] = run_id
        self.rows, self.step_rows = list(rows), list(step_rows)

    def finish(self) -> Path | None:
        """Completes both CSVs (rank 0) and returns the epochs' one's path."""
        if self.comm.Get_rank() != 0:
            return None
        epochs_csv, steps_csv = self._writers()
        steps_csv.finish()
        return epochs_csv.finish()

    def _writers(self) -> tuple[CsvWriter, CsvWriter]:
        if self.writers is None:
            out_dir = Path(self.config.out_dir)
            self.writers = (CsvWriter(out_dir / f"{self.run_id}.csv"),
                            CsvWriter(out_dir / f"{self.run_id}-steps.csv", STEP_COLUMNS))
            for writer, rows in zip(self.writers, (self.rows, self.step_rows)):
                for row in rows:
                    writer.add(row)
        return self.writers


def build_model(task, seed: int, comm: MPI.Comm):
    """The same initial weights on every rank, then a different random stream per rank (dropout)."""
    torch.manual_seed(seed)
    model = task.build_model()
    torch.manual_seed(seed * 1000 + 1 + comm.Get_rank())
    return model


def to_device(batch, device: torch.device):
    return tuple(t.to(device) for t in batch)


class MicroBatch(NamedTuple):
    """One forward and backward on this rank, part of an optimizer step."""

    indices: torch.Tensor  # this rank's samples (a stand-in when it has none)
    weight: float  # on this rank's loss sum: world size / samples in the whole optimizer step (0: stand-in)
    samples: int  # samples in this micro-batch over all ranks


def epoch_steps(num_samples: int, batching: Batching, comm: MPI.Comm, epoch: int, seed: int) -> list[list[MicroBatch]]:
    """This rank's optimizer steps in one epoch, each a list of up to `batching.grad_accum` micro-batches.

    The micro-batches of a step together hold the samples that one batch of
    ``batch_size * grad_accum`` would, and each rank's loss sum is weighted by
    world size over the step's global sample count, so that the averaged,
    accumulated gradient is the mean over the step's samples, also in the short
    steps at the end of an epoch. An empty share trains on a stand-in with weight 0,
    because every rank must still take part in the step's collectives.
    """
    world = comm.Get_size()
    batches = rank_batches(num_samples, batching.batch_size, comm.Get_rank(), world, seed, epoch)
    steps = []
    for first in range(0, len(batches), batching.grad_accum)[:batching.steps_per_epoch or None]:
        micro = range(first, min(first + batching.grad_accum, len(batches)))
        sizes = [global_batch_size(num_samples, batching.batch_size, world, m) for m in micro]
        step_total = sum(sizes)
        steps.append([MicroBatch(batches[m], world / step_total, size) if len(batches[m])
                      else MicroBatch(torch.zeros(1, dtype=torch.long), 0.0, size) for m, size in zip(micro, sizes)])
    return steps


def total_optimizer_steps(num_samples: int, batching: Batching, epochs: int, world: int) -> int:
    """Optimizer steps in the whole run (the learning-rate schedule's length); the same on every rank."""
    per_epoch = -(-steps_per_epoch(num_samples, batching.batch_size, world) // batching.grad_accum)
    return epochs * min(per_epoch, batching.steps_per_epoch or per_epoch)


@torch.no_grad()
def evaluate(task, model, batch_size: int, val_steps: int, seed: int, comm: MPI.Comm, device: torch.device,
             autocast=nullcontext) -> dict:
    """The validation columns, from `val_steps` batches per rank (0: all; the same ones every epoch), under `autocast`.

    `seed` is the run's: the validation order is drawn from seed + 1.
    """
    model.eval()
    totals: dict[str, float] = {}
    batching = Batching(batch_size, grad_accum=1, steps_per_epoch=val_steps)
    for (micro,) in epoch_steps(len(task.val), batching, comm, epoch=0, seed=seed + 1):
        with autocast():
            sums = task.eval_sums(model, to_device(task.val.batch(micro.indices, 0), device))
        for key, value in sums.items():
            totals[key] = totals.get(key, 0.0) + (value if micro.weight else 0.0)
    model.train()
    keys = sorted(totals)
    summed = numpy.array([totals[k] for k in keys], dtype=numpy.float64)
    comm.Allreduce(MPI.IN_PLACE, summed, op=MPI.SUM)  # element-wise (a pickled list's "sum" would concatenate)
    return task.val_columns(dict(zip(keys, summed.tolist())))


def optimizer_step(task, prepared, optimizer, schedule, step: list[MicroBatch], config: RunConfig, epoch: int,
                   device: torch.device) -> tuple[float, torch.Tensor]:
    """Accumulates the gradients of `step`'s micro-batches, clips them and updates the weights.

    Gradients are reduced on the last micro-batch, and on every one under a sharded
    strategy (which keeps gradient memory at 1/N) unless --accum-no-sync says otherwise.
    Under 16-mixed the loss is scaled, and a step whose gradients overflowed is skipped
    on every rank. Returns this rank's loss sum and its last micro-batch's per-sample losses.
    """
    loss_sum, losses, scaler = 0.0, None, prepared.scaler
    for position, micro in enumerate(step):
        defer_sync = position < len(step) - 1 and (config.accum_no_sync or not prepared.shards_gradients)
        with prepared.no_sync() if defer_sync else nullcontext():
            with prepared.autocast():
                losses = task.sample_losses(prepared.model, to_device(task.train.batch(micro.indices, epoch), device))
            scaler.scale(losses.sum() * micro.weight).backward()
        loss_sum += losses.sum().item() if micro.weight else 0.0
    if config.clip_norm:
        scaler.unscale_(optimizer)
        prepared.clip_grad_norm(config.clip_norm)
    scaler.step(optimizer)
    scaler.update()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)
    return loss_sum, losses


class EpochClock:
    """Adds the wall time, communication time and bytes of training steps to an EpochTally; paused while saving."""

    def __init__(self, prepared: Prepared, tally: EpochTally):
        self.prepared, self.tally = prepared, tally
        self.marks = None

    def start(self) -> None:
        self.marks = (time.perf_counter(), self.prepared.comm_seconds(), self.prepared.comm_bytes())

    def pause(self) -> None:
        start, comm_seconds, comm_bytes = self.marks
        self.tally.seconds += time.perf_counter() - start
        self.tally.comm_seconds += self.prepared.comm_seconds() - comm_seconds
        self.tally.comm_bytes += self.prepared.comm_bytes() - comm_bytes


@dataclass
class Run:
    """What the training loop's parts share: the task and config, the wrapped model, its optimizer and schedule."""

    task: object
    config: RunConfig
    comm: MPI.Comm
    device: torch.device
    prepared: Prepared
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    recorder: RunRecorder
    total_steps: int  # optimizer steps in the whole run


def train(task, config: RunConfig, comm: MPI.Comm, device: torch.device, experiment: str,
          stop: StopSignals) -> tuple[Path | None, Stopped | None]:
    """The training loop for fsdp-mpi, ddp and torch-fsdp: (the CSV's path on rank 0, how a signal stopped it).

    Under --resume it continues from the latest checkpoint. After every optimizer step
    the ranks agree whether a stop signal arrived; if so they save a checkpoint (with
    --checkpoint-dir), write the rows of the epochs completed, and return.
    """
    model = build_model(task, config.seed, comm)
    recorder = RunRecorder(task, config, comm, device, experiment, model)
    prepared = prepare(config.strategy, model, task.block_class, device, comm, config.precision)
    total_steps = total_optimizer_steps(len(task.train), config.batching, config.epochs, comm.Get_size())
    optimizer, schedule = optimizer_and_schedule(prepared.model, total_steps, config.lr, config.weight_decay,
                                                 config.warmup_steps)
    run = Run(task, config, comm, device, prepared, optimizer, schedule, recorder, total_steps)
    checkpoints = RunCheckpoints(run) if config.checkpoint_dir else None
    # Restored last: loading sets the random generators, which the set-up above draws from.
    position = checkpoints.restore() if config.resume else Position()
    while position.epoch < config.epochs:
        stopped = train_epoch(run, position, stop, checkpoints)
        if stopped:
            return recorder.finish(), stopped
        finish_epoch(run, position)
    if checkpoints:
        checkpoints.save(position)
    if config.save_dir:
        save_trained(task, full_state_dict_on_rank0(config.strategy, prepared.model, comm), config, recorder)
    return recorder.finish(), None


def train_epoch(run: Run, position: Position, stop: StopSignals, checkpoints: RunCheckpoints | None) -> Stopped | None:
    """The optimizer steps left in `position`'s epoch, added to its tally.

    Between steps: stops (saving first, with checkpoints) if some rank received a stop
    signal, and saves when --checkpoint-every says so.
    """
    from tqdm import tqdm

    config, comm, tally = run.config, run.comm, position.tally
    steps = epoch_steps(len(run.task.train), config.batching, comm, position.epoch, config.seed)
    progress = tqdm(steps[tally.steps:], initial=tally.steps, total=len(steps), desc=f"epoch {position.epoch}",
                    disable=config.no_progress or comm.Get_rank() != 0, file=sys.stdout, dynamic_ncols=True)
    clock = EpochClock(run.prepared, tally)
    comm.Barrier()
    clock.start()
    for step in progress:
        step_loss, losses = optimizer_step(run.task, run.prepared, run.optimizer, run.schedule, step, config,
                                           position.epoch, run.device)
        tally.add_step(step_loss, sum(micro.samples for micro in step))
        position.step += 1
        if comm.Get_rank() == 0:
            progress.set_postfix(loss=f"{losses.mean().item():.3f}")
        received = stop.agreed(run.prepared.allreduce_max)
        if received or (checkpoints and checkpoints.due(position.step)):
            clock.pause()
            saved = checkpoints.save(position) if checkpoints else None
            if received:
                progress.close()
                return Stopped(received.name, position.step, run.total_steps, saved)
            clock.start()
    if run.device.type == "cuda":
        torch.cuda.synchronize(run.device)
    comm.Barrier()
    clock.pause()
    return None


def finish_epoch(run: Run, position: Position) -> None:
    """Validates, writes the epoch's CSV rows from its tally, and moves `position` to the next epoch."""
    tally, config = position.tally, run.config
    val = evaluate(run.task, run.prepared.model, config.batch_size, config.val_steps, config.seed, run.comm,
                   run.device, run.prepared.autocast)
    run.recorder.add_epoch(position.epoch, position.step - tally.steps, tally, val,
                           model_state_bytes(run.prepared.model, run.optimizer), run.device)
    position.epoch, position.tally = position.epoch + 1, EpochTally()


def save_trained(task, state: dict | None, config: RunConfig, recorder: RunRecorder) -> None:
    """Rank 0 writes the trained weights in Hugging Face's layout to --save-dir, the task's extras and run.json."""
    if state is None:
        return
    directory = Path(config.save_dir)
    model = task.build_model()
    model.load_state_dict(state)
    model.save_pretrained(directory)
    if hasattr(task, "save_extras"):
        task.save_extras(directory)
    write_run_file(directory, recorder.fixed["experiment"], config.as_dict(), recorder.fixed)

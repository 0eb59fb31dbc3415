"""What both experiments share: start-up and the training loop (the command line is ``options``, which
samples each step takes is ``sampling``, the CSV rows are ``recorder``).

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
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy
import torch

from corpora.files import DataError
from options import RunConfig, UsageError, check_checkpoint_options, check_config
from recipe import optimizer_and_schedule
from recorder import RunRecorder
from results import model_state_bytes
from resume import EpochTally, Position, ResumeError, RunCheckpoints, StopSignals, Stopped
from saved_run import write_run_file
from sampling import Batching, MicroBatch, epoch_steps, total_optimizer_steps
from strategies import TORCH_DISTRIBUTED, Prepared, full_state_dict_on_rank0, node_placement, prepare

from fsdp_mpi import CheckpointError as ShardedCheckpointError
from fsdp_mpi import Communicator, abort_job_on_uncaught_exception
from fsdp_mpi.launcher import LauncherMismatchError
from models.checkpoint import CheckpointError


def pick_device(choice: str, local_rank: int) -> torch.device:
    """The device for --device `choice`: a rank on a GPU node takes the GPU of its node-local rank (``local_rank``,
    from ``strategies.node_placement``). No collective: rank 0 calls it alone in ``set_up_rank_0_first``."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def _set_up(task_type, config: RunConfig, comm: Communicator, node: tuple[int, int]):
    """(task, device, None) or (None, None, error message) for input this machine cannot run.

    `node`: this rank's place on its node and the node's rank count (``strategies.node_placement``).
    """
    try:
        check_config(config)
        torch.set_num_threads(config.threads)
        local_rank, ranks_on_node = node
        device = pick_device(config.device, local_rank)
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        if config.strategy in TORCH_DISTRIBUTED and device.type == "cuda" and ranks_on_node > gpus:
            raise UsageError(f"{config.strategy} communicates through nccl, which cannot share a GPU between ranks: "
                             f"this node runs {ranks_on_node} ranks on {gpus} visible GPU(s). "
                             "Start one rank per GPU, or use fsdp-mpi or lightning-fsdp-mpi, which can share one")
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
    comm = communicator_for_the_run(parser.prog)
    if comm is None:
        return 2
    stop = listen_for_stop_signals(config.strategy)
    node = node_placement(comm)  # here, on every rank: set-up runs on rank 0 alone first
    values, error = set_up_rank_0_first(lambda: _set_up(task_type, config, comm, node), comm)
    if error:
        if comm.rank == 0:
            print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    task, device = values
    announce_devices(device, comm)
    if comm.world_size > 1:
        abort_job_on_uncaught_exception(comm.mpi_comm)
    stopped = None
    if config.strategy.startswith("lightning"):
        from lightning_runner import train_with_lightning

        path = train_with_lightning(task, config, comm, device, experiment)
    else:
        try:
            path, stopped = train(task, config, comm, device, experiment, stop)
        except (ShardedCheckpointError, ResumeError) as failure:  # raised on every rank alike
            if comm.rank == 0:
                print(f"{parser.prog}: error: {failure}", file=sys.stderr)
            return 2
    if comm.rank == 0:
        print(f"wrote {path}" + (" (the epochs completed so far)" if stopped else ""))
        if stopped:
            print(stopped.message(), flush=True)
    return stopped.exit_code if stopped else 0


def communicator_for_the_run(prog: str) -> Communicator | None:
    """The run's one Communicator over all ranks, through which every collective of the experiments goes (logged,
    watched for hangs, checked in verify mode); None, with the error printed, under a launcher that does not match
    the MPI (N one-rank worlds would each write a run of their own) or with a bad FSDP_MPI_* setting."""
    try:
        return Communicator()
    except (LauncherMismatchError, ValueError) as failure:
        print(f"{prog}: error: {failure}", file=sys.stderr)
        return None


def set_up_rank_0_first(set_up, comm: Communicator) -> tuple[list | None, str | None]:
    """Runs ``set_up()`` (which returns its values and, last, an error message or None) on rank 0 first,
    which may download what is missing, then on the others only if it succeeded: every rank gets the
    same first error instead of some waiting for a rank that failed. Returns (the values, that error).

    ``set_up`` must make no collective: rank 0 runs it while the others wait here in a broadcast.
    """
    values = error = None
    if comm.rank == 0:
        *values, error = set_up()
    error = comm.broadcast_object(error, root=0)
    if error is None and comm.rank != 0:
        *values, error = set_up()
    errors = [e for e in comm.allgather_object(error) if e]
    return values, (errors[0] if errors else None)


def announce_devices(device: torch.device, comm: Communicator) -> None:
    """Rank 0 prints every rank's device in one line when some rank is not on the CPU (every rank calls this):
    the first sign that a GPU job got past set-up, and of which rank took which GPU."""
    devices = comm.allgather_object(str(device))
    if comm.rank == 0 and any(name != "cpu" for name in devices):
        print("devices: " + ", ".join(f"rank {rank} {name}" for rank, name in enumerate(devices)), flush=True)


def listen_for_stop_signals(strategy: str) -> StopSignals:
    """Our training loop stops between optimizer steps on SIGTERM or SIGUSR1.

    Lightning's loop cannot: there SIGUSR1 (the hpc/ scripts' warning before the time
    limit) is ignored, so that the run goes on until the limit, and SIGTERM ends it as usual.
    """
    if strategy.startswith("lightning"):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        return StopSignals()
    return StopSignals().install()


def build_model(task, seed: int, comm: Communicator):
    """The same initial weights on every rank, then a different random stream per rank (dropout)."""
    torch.manual_seed(seed)
    model = task.build_model()
    torch.manual_seed(seed * 1000 + 1 + comm.rank)
    return model


def to_device(batch, device: torch.device):
    return tuple(t.to(device) for t in batch)


@torch.no_grad()
def evaluate(task, model, batch_size: int, val_steps: int, seed: int, comm: Communicator, device: torch.device,
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
    comm.all_reduce_sum_(torch.from_numpy(summed))  # element-wise, in place (the tensor shares summed's memory)
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
    comm: Communicator
    device: torch.device
    prepared: Prepared
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler
    recorder: RunRecorder
    total_steps: int  # optimizer steps in the whole run


def train(task, config: RunConfig, comm: Communicator, device: torch.device, experiment: str,
          stop: StopSignals) -> tuple[Path | None, Stopped | None]:
    """The training loop for fsdp-mpi, ddp and torch-fsdp: (the CSV's path on rank 0, how a signal stopped it).

    Under --resume it continues from the latest checkpoint. After every optimizer step
    the ranks agree whether a stop signal arrived; if so they save a checkpoint (with
    --checkpoint-dir), write the rows of the epochs completed, and return.
    """
    model = build_model(task, config.seed, comm)
    recorder = RunRecorder(task, config, comm, device, experiment, model)
    prepared = prepare(config.strategy, model, task.block_class, device, comm, config.precision)
    total_steps = total_optimizer_steps(len(task.train), config.batching, config.epochs, comm.world_size)
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
                    disable=config.no_progress or comm.rank != 0, file=sys.stdout, dynamic_ncols=True)
    clock = EpochClock(run.prepared, tally)
    comm.barrier()
    clock.start()
    for step in progress:
        step_loss, losses = optimizer_step(run.task, run.prepared, run.optimizer, run.schedule, step, config,
                                           position.epoch, run.device)
        tally.add_step(step_loss, sum(micro.samples for micro in step))
        position.step += 1
        if comm.rank == 0:
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
    comm.barrier()
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

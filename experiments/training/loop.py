"""Our training loop, for fsdp-mpi, ddp and torch-fsdp (Lightning's strategies train in ``lightning_runner``).

The loop stops between optimizer steps on SIGTERM or SIGUSR1 and, under fsdp-mpi,
checkpoints and resumes bit for bit; what a checkpoint holds is in ``resume``.
Which samples each step takes is ``sampling``, the CSV rows are ``recorder``; ``run``
starts the loop from the command line.
"""

import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from training.evaluation import evaluate, to_device
from training.keep_going import Left, go_on_without_the_lost, join_the_run
from training.options import RunConfig
from training.recipe import optimizer_and_schedule
from training.recorder import RunRecorder
from training.results import model_state_bytes
from training.resume import EpochTally, Position, ResumeError, RunCheckpoints, Stopped
from training.sampling import Batching, MicroBatch, epoch_steps, seed_step, total_optimizer_steps
from training.saved_run import save_trained
from training.strategies import Prepared, build_model, compression_from_option, full_state_dict_on_rank0, prepare

from fsdp_mpi import (Communicator, CPUOffload, RankLostError, SampleKeys, ShardingStrategy, StopSignals,
                      continuation_unavailable, is_newcomer, step_in_backward)
from fsdp_mpi.communication.failures.job import add_hosts_from
from fsdp_mpi.elastic import recovery
from fsdp_mpi.elastic.agreement import end_step
from fsdp_mpi.files.checkpoint_directory import CheckpointDirectory


def optimizer_step(run: "Run", step: list[MicroBatch], position: Position) -> tuple[float, torch.Tensor]:
    """Accumulates the gradients of `step`'s micro-batches, clips them and updates the weights.

    Gradients are reduced on the last micro-batch, and on every one under a sharded
    strategy (which keeps gradient memory at 1/N) unless --accum-no-sync says otherwise.
    Under 16-mixed the loss is scaled, and a step whose gradients overflowed is skipped
    on every rank. Dropout draws each sample's masks from (seed, the run's step, the sample): the same on any
    number of ranks. Returns the step's loss sum over all ranks and this rank's last micro-batch's per-sample
    losses. Under --keep-going the step ends in its one agreement before the update, so that every survivor takes
    it or none does (fsdp_mpi.elastic.agreement).
    Under --step-in-backward the last micro-batch's backward takes the step itself, unit by unit.
    """
    task, prepared, optimizer, config = run.task, run.prepared, run.optimizer, run.config
    loss_sum, losses, scaler = 0.0, None, prepared.scaler
    for index, micro in enumerate(step):
        last = index == len(step) - 1
        defer_sync = not last and (config.accum_no_sync or not prepared.shards_gradients)
        stepping = last and config.step_in_backward  # the optimizer steps inside this backward
        run.dropout_keys.set_batch(position.step, micro.indices)
        with prepared.no_sync() if defer_sync else nullcontext():
            with prepared.autocast():
                batch = to_device(task.train.batch(micro.indices, position.epoch), run.device)
                losses = task.sample_losses(prepared.model, batch)
            with step_in_backward(prepared.model, optimizer) if stepping else nullcontext():
                scaler.scale(losses.sum() * micro.weight).backward()
        loss_sum += losses.sum().item() if micro.weight else 0.0
    loss_sum = run.comm.all_reduce_sum_float(loss_sum)
    if config.step_in_backward:  # stepped, gradients cleared; no clipping, keep-going or fp16 (options.py)
        run.schedule.step()
        return loss_sum, losses
    if config.clip_norm:
        scaler.unscale_(optimizer)
        prepared.clip_grad_norm(config.clip_norm)
    if config.keep_going:  # the step's one agreement: every survivor takes it, or none does (fsdp_mpi.elastic)
        if not scaler.unscaled:  # fp16's found-inf reduction is a collective: inside the step, not after it
            scaler.unscale_(optimizer)
        end_step(run.comm)
    scaler.step(optimizer)
    scaler.update()
    run.schedule.step()
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
    batching: Batching  # the options' batching, with the ranks the run started on
    total_steps: int  # optimizer steps in the whole run
    dropout_keys: SampleKeys  # set before each micro-batch: dropout's masks follow the sample
    experiment: str  # the CSVs' name for it


def train(task, config: RunConfig, comm: Communicator, device: torch.device, experiment: str,
          stop: StopSignals) -> tuple[Path | None, Stopped | None]:
    """The training loop for fsdp-mpi, ddp and torch-fsdp: (the CSV's path on rank 0, how a signal stopped it).

    Under --resume it continues from the latest checkpoint. After every optimizer step
    the ranks agree whether a stop signal arrived; if so they save a checkpoint (with
    --checkpoint-dir), write the rows of the epochs completed, and return. Under --keep-going a lost rank does
    not end the run: the survivors go on (``keep_going``); a rank that leaves gets (None, ``Left``).
    """
    batching = run_batching(config, comm)
    unavailable = continuation_unavailable() if config.keep_going else None
    if unavailable and comm.rank == 0:
        print(f"--keep-going is unavailable, so a lost rank ends the job: {unavailable}", flush=True)
    if config.add_hosts:  # read at every step boundary while ranks are missing (fsdp_mpi.elastic.agreement)
        add_hosts_from(config.add_hosts)
    if is_newcomer():  # started in a lost rank's place (--grow-back): the others are in their recovery
        run, position = join_the_run(lambda on: start_run(task, config, on, device, experiment, batching), config,
                                     comm)
        checkpoints = RunCheckpoints(run) if config.checkpoint_dir else None
    else:
        run = start_run(task, config, comm, device, experiment, batching)
        checkpoints = RunCheckpoints(run) if config.checkpoint_dir else None
        # Restored last: loading sets the random generators, which the set-up above draws from.
        position = checkpoints.restore() if config.resume else Position()
        if config.keep_going and checkpoints and not config.resume:
            checkpoints.save(position)  # step 0: a rank lost before the first periodic save has something to reload
    while True:
        try:
            stopped = train_to_the_end(run, position, stop, checkpoints)
            if config.keep_going:  # the run's last agreement: no rank leaves while others recover
                end_step(run.comm)
            return run.recorder.finish(), stopped
        except RankLostError as error:
            if not config.keep_going:
                raise
            lost = error
        survived = go_on_without_the_lost(run, position, lost, start_run)  # outside the except: its frames freed
        if isinstance(survived, Left):
            return None, survived
        run, position = survived
        checkpoints = RunCheckpoints(run) if config.checkpoint_dir else None
        del survived
        recovery.collect_the_old_run()


def start_run(task, config: RunConfig, comm: Communicator, device: torch.device, experiment: str,
              batching: Batching) -> "Run":
    """The model built and wrapped on `comm`'s ranks, its optimizer, schedule and CSV recorder."""
    deferred = config.strategy == "fsdp-mpi"  # never the whole model on a rank, as the run starts or rebuilds
    model, dropout_keys = build_model(task, config.seed, comm, deferred)
    recorder = RunRecorder(task, config, comm, device, experiment, model, batching)
    prepared = prepare(config.strategy, model, task.block_class, device, comm, config.precision, config.backend,
                       init_seed=config.seed if deferred else None,
                       compression=compression_from_option(config.comm_compression),
                       sharding_strategy=ShardingStrategy[config.sharding_strategy],
                       cpu_offload=CPUOffload(offload_params=True) if config.cpu_offload else None)
    total_steps = total_optimizer_steps(len(task.train), batching, config.epochs, comm.world_size)
    optimizer, schedule = optimizer_and_schedule(prepared.model, total_steps, config.lr, config.weight_decay,
                                                 config.warmup_steps)
    return Run(task, config, comm, device, prepared, optimizer, schedule, recorder, batching, total_steps,
               dropout_keys, experiment)


def train_to_the_end(run: "Run", position: Position, stop: StopSignals,
                     checkpoints: RunCheckpoints | None) -> Stopped | None:
    """The epochs left from `position`, then the last checkpoint and the saved model; how a signal stopped it."""
    config = run.config
    while position.epoch < config.epochs:
        stopped = train_epoch(run, position, stop, checkpoints)
        if stopped:
            return stopped
        finish_epoch(run, position)
    if checkpoints:
        checkpoints.save(position)
    if config.save_dir:
        save_trained(run.task, full_state_dict_on_rank0(config.strategy, run.prepared.model, run.comm), config,
                     run.recorder.fixed)
    return None


def run_batching(config: RunConfig, comm: Communicator) -> Batching:
    """The options' batching on the ranks the run started on: these, or under --resume those of its checkpoints,
    whose global batch every later step keeps."""
    started_on = comm.world_size
    if config.resume:
        directory = CheckpointDirectory(config.checkpoint_dir, comm)
        started_on = (directory.read_started_on() if is_newcomer() else directory.started_on()) or started_on
    batching = replace(config.batching, started_on=started_on)
    if batching.global_batch(comm.world_size) < comm.world_size:
        samples = batching.global_batch(comm.world_size)
        raise ResumeError(f"the run started on {started_on} rank(s) takes {samples} sample(s) per optimizer step: "
                          f"{comm.world_size} ranks cannot each take one; resume it on {samples} rank(s) at most")
    return batching


def train_epoch(run: Run, position: Position, stop: StopSignals, checkpoints: RunCheckpoints | None) -> Stopped | None:
    """The optimizer steps left in `position`'s epoch, added to its tally.

    Between steps: stops (saving first, with checkpoints) if some rank received a stop
    signal, and saves when --checkpoint-every says so.
    """
    from tqdm import tqdm

    config, comm, tally = run.config, run.comm, position.tally
    steps = epoch_steps(len(run.task.train), run.batching, comm, position.epoch, config.seed)
    progress = tqdm(steps[tally.steps:], initial=tally.steps, total=len(steps), desc=f"epoch {position.epoch}",
                    disable=config.no_progress or comm.rank != 0, file=sys.stdout, dynamic_ncols=True)
    clock = EpochClock(run.prepared, tally)
    comm.barrier()
    clock.start()
    for step in progress:
        seed_step(config.seed, position.step, comm.rank)
        step_loss, losses = optimizer_step(run, step, position)
        tally.add_step(step_loss, sum(micro.samples for micro in step), comm.world_size)
        position.step += 1
        if comm.rank == 0:
            progress.set_postfix(loss=f"{losses.mean().item():.3f}")
        received = stop.agreed(run.prepared.all_reduce_max)
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
                   run.device, run.prepared.autocast, run.batching.started_on)
    run.recorder.add_epoch(position.epoch, position.step - tally.steps, tally, val,
                           model_state_bytes(run.prepared.model, run.optimizer), run.device)
    position.epoch, position.tally = position.epoch + 1, EpochTally()



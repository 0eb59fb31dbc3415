"""A Lightning Trainer that goes on after a lost rank, in the same job (Open MPI's ULFM): ``fit_elastic``.

    def build(comm):                                     # every rank; again after each loss or growth
        strategy = FSDPMPIStrategy(comm=comm, auto_wrap_policy={Block})
        trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=comm.world_size, max_steps=1000)
        return trainer, Module()                         # (trainer, module) or (trainer, module, datamodule)

    fit_elastic(build, checkpoint_dir="ckpt", checkpoint_every=50)   # mpirun --with-ft ulfm -n 8 python train.py

A Trainer cannot be rebuilt on fewer ranks in the middle of ``fit`` (its loops, callbacks,
loggers and samplers are cut for the ranks it started on), so this builds a new one instead,
as a user would by hand, but without ending the job: every optimizer step ends in the ranks'
one agreement (the strategy's precision plugin calls it after the clipping, before the update);
a loss anywhere in ``fit`` makes every survivor leave ``fit``, shrink, build the Trainer again
on the survivors (``build(comm)``) and resume it from the latest checkpoint of
`checkpoint_dir`, which this saves every `checkpoint_every` optimizer steps (and at the start).
With `grow_back` the survivors start a newcomer in each lost rank's place, or grow back into
hosts added to `hosts_file`, and every rank resumes from that checkpoint on the job's size.

The protocol, the recovery and the newcomers' join are ``run_elastic``'s (``elastic/``): the
state comes back from a checkpoint only, never from a replica's memory (``Plan.held`` None),
because the loops' state lives nowhere else. The steps since the latest checkpoint are taken
again. What the module owes: its data follows from the step, not from the number of ranks (each
rank's part of a global batch cut anew on the ranks of the moment), and resuming a checkpoint
saved mid-epoch continues at the same sample (one step per epoch, or a dataloader that Lightning
can resume, with ``state_dict``).
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import lightning as L
from lightning.pytorch.callbacks import Callback

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.failures.job import is_newcomer
from fsdp_mpi.elastic.recovery import Plan, join
from fsdp_mpi.elastic.runner import Elastic, go_on_through_losses, recovered, set_up
from fsdp_mpi.files.checkpoint_directory import CheckpointDirectory
from fsdp_mpi.lightning import FSDPMPIStrategy

@dataclass
class _Fit:
    """One Trainer's fit on one set of ranks: what the recovery rebuilds after a loss."""

    comm: Communicator
    trainer: L.Trainer
    module: L.LightningModule
    datamodule: L.LightningDataModule | None
    resume_from: Path | None = None  # the checkpoint ``fit`` starts from
    step: int = 0  # the optimizer step it starts at

    def resume_at_latest(self, directory: CheckpointDirectory) -> bool:
        """Makes ``fit`` start from `directory`'s latest checkpoint (collective); False where there is none."""
        self.resume_from = directory.latest()
        self.step = int(self.resume_from.name.split("-")[1]) if self.resume_from else 0
        return self.resume_from is not None

    def release(self) -> None:
        """Frees the optimizer state a reload replaces, before the next Trainer is built beside this one."""
        for optimizer in self.trainer.strategy.optimizers:
            optimizer.state.clear()

    def fit(self) -> L.Trainer:
        # weights_only: these checkpoints hold only what Lightning and the strategy write (load_lightning_state)
        self.trainer.fit(self.module, datamodule=self.datamodule, ckpt_path=self.resume_from, weights_only=True)
        return self.trainer


class _StepCheckpoints(Callback):
    """Saves the Trainer into a ``CheckpointDirectory`` every `every` optimizer steps, and at the start of a run
    that has none yet (so that a loss before the first periodic save has something to reload)."""

    def __init__(self, directory: CheckpointDirectory, every: int, started_on: int):
        self.directory, self.every, self.started_on = directory, every, started_on
        self.saved = -1  # the step last saved: a step's micro-batches each end a batch
        self.saved_at: Path | None = None  # where this callback saved it

    def on_train_start(self, trainer, module) -> None:
        if self.directory.latest() is None:
            self._save(trainer)
        self.saved = trainer.global_step  # saved now, or resumed from

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_index) -> None:
        if trainer.global_step % self.every == 0:
            self._save(trainer)

    def _save(self, trainer) -> None:
        if trainer.global_step != self.saved:
            self.saved_at = self.directory.save_by(
                trainer.global_step, lambda path: trainer.save_checkpoint(path, weights_only=False), self.started_on)
            self.saved = trainer.global_step

    def save_now(self, trainer) -> Path:
        """The Trainer saved at this step (collective; once per step), where the next ``fit_elastic`` resumes: a
        SLURM requeue's checkpoint (lightning_requeue.py), so that the requeued job loses no step."""
        self._save(trainer)
        return self.saved_at


def fit_elastic(build: Callable[[Communicator], tuple], checkpoint_dir: str | Path, checkpoint_every: int, *,
                comm: Communicator | None = None, grow_back: bool = False, hosts_file: str | Path | None = None,
                elastic: Elastic | None = None) -> L.Trainer | None:
    """Fits the Trainer that ``build(comm)`` makes and, after each lost rank, one built again on the ranks that go
    on, resumed from the latest checkpoint.

    Args:
        build: ``(trainer, module)`` or ``(trainer, module, datamodule)`` for a communicator's ranks; the trainer's
            strategy is ``FSDPMPIStrategy(comm=comm, ...)``, over exactly those ranks.
        checkpoint_dir: where the Trainer is saved every `checkpoint_every` optimizer steps and at the start; a
            directory that already holds checkpoints is resumed from.
        comm: the ranks to train on (all of them by default).
        grow_back: after a loss, start a newcomer running this program in each lost rank's place where the
            allocation has a free slot, and go on with as many ranks as before (as ``run_elastic``'s).
        hosts_file: with `grow_back`, a file of ``HOST:SLOTS`` lines read at every step boundary while ranks are
            missing: the run grows back into hosts added to it.
        elastic: filled with what the run went through (recoveries, lost ranks, whether this rank left).

    Returns the last Trainer that fitted, None on a rank that left. Where MPI cannot report a lost rank, says so
    once and fits as usual (a lost rank then ends the job); where nothing holds the lost state, says why and ends
    every survivor with exit code 2.
    """
    if checkpoint_every < 1:
        raise ValueError("checkpoint_every must be at least 1: a Trainer that lost a rank resumes from the latest "
                         "checkpoint")
    comm, elastic, unavailable = set_up(comm, grow_back, hosts_file, elastic, "fsdp_mpi.lightning_elastic")
    directory = lambda on: CheckpointDirectory(checkpoint_dir, on)  # noqa: E731 (one line, as the Plan's)
    started_on = comm.world_size
    plan = Plan(build=lambda on: _built(build, on, directory(on), checkpoint_every, started_on),
                shard_comm=lambda run: run.comm, replica_comm=lambda run: None, held=None, take=None,
                from_checkpoint=lambda run: run.resume_at_latest(directory(run.comm)),
                position=lambda run: run.step, release=_Fit.release, grow_back=grow_back)

    def start() -> _Fit:
        if is_newcomer():  # started by the survivors' recovery, in a lost rank's place
            elastic.newcomer = True
            return recovered(join(comm, plan), 0.0, elastic, plan)
        run = plan.build(comm)
        run.resume_at_latest(directory(comm))
        return run

    return go_on_through_losses(start, _Fit.fit, plan, elastic, unavailable)


def _built(build: Callable[[Communicator], tuple], comm: Communicator, directory: CheckpointDirectory,
           every: int, started_on: int) -> _Fit:
    """`build(comm)`, checked, its strategy made to keep going and its Trainer to save into `directory`, sharded
    (every rank writes its part at once, and ``CheckpointDirectory`` keeps directories)."""
    made = build(comm)
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise TypeError(f"build(comm) must return (trainer, module) or (trainer, module, datamodule), not {made!r}")
    trainer, module, datamodule = (*made, None)[:3]
    strategy = getattr(trainer, "strategy", None)
    if not isinstance(strategy, FSDPMPIStrategy) or strategy.comm is not comm:
        raise TypeError("build(comm)'s Trainer must train with FSDPMPIStrategy(comm=comm, ...) on the communicator "
                        f"it is given (its strategy: {type(strategy).__name__})")
    strategy.keeps_going = True
    strategy.state_dict_type = "sharded"
    checkpoints = _StepCheckpoints(directory, every, started_on)
    trainer.callbacks.append(checkpoints)
    strategy.requeue_saves = checkpoints.save_now
    return _Fit(comm, trainer, module, datamodule)

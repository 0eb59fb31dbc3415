"""The training state that survives a lost rank: one object, whose ``commit()`` ends each optimizer step.

``ElasticState`` holds the wrapped model, its optimizer, learning-rate schedule and loss
scaler, how far training has come (``step``, optimizer steps taken), the ranks the run
started on (its global batch: each step's samples are the same on any number of ranks)
and the loop's own counters (``counters``: an epoch, a sample index, running sums).

``commit()`` is the end of a step and its one agreement (``agreement.end_step``): the
weights change only after every rank has agreed that the step was complete. So the state
in memory is always the last commit plus this step's gradients: going back to the commit
drops the gradients and restores the counters, and no copy of the model or optimizer is
kept for it. (Horovod Elastic's ``commit()`` copies the state instead, and restores it
after the update; here no update happens that might need undoing.)

After a loss the state moves to the ranks that go on one of two ways (``recovery.py``): from
memory, where a shard group is left whole or a newcomer's twin holds its shards (HYBRID_SHARD,
NO_SHARD: ``held``/``take``), or from the latest checkpoint (``save``/``load``), resharded
onto their number.
"""

import copy
from pathlib import Path

import torch
from torch import nn

from fsdp_mpi.elastic.agreement import end_step
from fsdp_mpi.elastic.recovery import put_shards, shards_of
from fsdp_mpi.files.checkpoint import load_checkpoint
from fsdp_mpi.files.checkpoint_directory import CheckpointDirectory
from fsdp_mpi.loop.grad_scaler import ShardedGradScaler


class ElasticState:
    """A run's training state, committed at the end of every optimizer step.

    Args:
        model: the ``FullyShardedDataParallel`` model (its ``comm`` is the run's ranks).
        optimizer: built from ``model.parameters()``.
        schedule: a learning-rate scheduler, stepped with each commit (optional).
        scaler: a ``ShardedGradScaler`` for fp16 (optional): unscaled before the agreement, whose found-inf
            reduction is a collective and so belongs to the step, not after it.
        counters: the loop's own values to keep with each commit (numbers, lists, dicts: copied, not shared).
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, *, schedule=None,
                 scaler: ShardedGradScaler | None = None, **counters):
        self.model, self.optimizer, self.schedule, self.scaler = model, optimizer, schedule, scaler
        self.comm = model.comm
        self.step = 0  # optimizer steps committed
        self.started_on = self.comm.world_size  # the ranks whose global batch every step keeps
        self.counters = counters
        self._committed = copy.deepcopy(counters)
        self._checkpoints: tuple[CheckpointDirectory, int] | None = None  # where, and every how many steps

    def keep_checkpoints(self, directory: CheckpointDirectory, every: int) -> None:
        """Makes every `every`-th commit save the state into `directory` (after the update: the save belongs to
        the next step, so a rank lost while saving abandons that one, and ``latest`` still names a whole
        checkpoint)."""
        self._checkpoints = (directory, every)

    def commit(self) -> None:
        """Ends an optimizer step on every rank alike (collective): agrees that every rank's step was complete,
        then updates the weights, steps the schedule, clears the gradients and keeps the counters. Raises
        ``StepAbandoned`` (the weights unchanged) if a rank was lost in the step; ``elastic.run`` recovers."""
        if self.scaler is not None and not self.scaler.unscaled:
            self.scaler.unscale_(self.optimizer)
        end_step(self.comm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        if self.schedule is not None:
            self.schedule.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self._committed = copy.deepcopy(self.counters)
        if self._checkpoints is not None and self.step % self._checkpoints[1] == 0:
            self.save(self._checkpoints[0])

    def roll_back(self) -> None:
        """Back to the last commit (local): this step's gradients dropped, the counters as committed."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.scaler is not None:
            self.scaler.abandon_step()
        self.counters = copy.deepcopy(self._committed)

    def held(self) -> dict:
        """This rank's committed state: its shards, its optimizer's state and the rest (``state_dict``), as
        ``take`` puts it into a state built on the ranks that go on (a twin sends it to its newcomer pickled)."""
        return {"shards": shards_of(self.model), "optimizer": self.optimizer.state_dict(),
                "state": self.state_dict()}

    def take(self, held: dict) -> None:
        """Puts `held` (``held()`` of a rank in this one's place: the same shard group size and position, so that
        every parameter's shard has the same elements) into this state."""
        put_shards(self.model, held["shards"])
        self.optimizer.load_state_dict(held["optimizer"])
        self.load_state_dict(held["state"])

    def state_dict(self) -> dict:
        """Everything but the model's and optimizer's tensors: the step, counters, schedule, scaler."""
        return {"step": self.step, "started_on": self.started_on, "counters": copy.deepcopy(self._committed),
                "schedule": self.schedule.state_dict() if self.schedule is not None else None,
                "scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.started_on = state["step"], state["started_on"]
        self.counters, self._committed = copy.deepcopy(state["counters"]), copy.deepcopy(state["counters"])
        if self.schedule is not None:
            self.schedule.load_state_dict(state["schedule"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])

    def save(self, directory: CheckpointDirectory) -> Path:
        """The committed state saved as `directory`'s newest step checkpoint (collective)."""
        return directory.save(self.step, self.model, self.optimizer, self.state_dict(), self.started_on)

    def load(self, directory: CheckpointDirectory) -> bool:
        """The latest checkpoint in `directory` loaded into this state, resharded onto these ranks (collective);
        False where there is none yet (the state stays as built)."""
        latest = directory.latest()
        if latest is None:
            return False
        self.load_state_dict(load_checkpoint(latest, self.model, self.optimizer, restore_rng=False))
        return True

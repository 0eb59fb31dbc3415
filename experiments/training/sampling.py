"""Which samples each rank trains on: the same global batches in the same order, whatever the number of ranks.

Each epoch shuffles all sample indices with (seed, epoch) into one global order,
and optimizer step s takes the s-th slice of it, ``global_batch`` samples (the last
one shorter). So which samples a step trains on does not depend on the ranks: a
run stopped on N ranks continues on M at the same sample (``resume.py``). Within a
step, micro-batches of up to ``batch_size`` samples per rank take consecutive
parts of the slice, rank r every world_size-th sample of each part from the r-th.
The ranks the run started on fix the global batch (``batch_size x grad_accum x
started_on``); on other ranks the number of micro-batches follows from it. Across
ranks every sample is used exactly once per epoch: none dropped, none repeated.
Ranks may then hold batches of different sizes (or none), so each rank weights its
loss by world size over the step's sample count; the averaged gradient is then
exactly that of the global batch.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


@dataclass(frozen=True)
class Batching:
    """How an epoch's samples become optimizer steps on each rank."""

    batch_size: int  # samples per rank per micro-batch, at most
    grad_accum: int = 1  # micro-batches per optimizer step on the ranks the run started on
    steps_per_epoch: int = 0  # optimizer steps per epoch; 0: as many as the epoch's samples fill
    started_on: int = 0  # the ranks the run started on (0: the ranks it runs on)

    def global_batch(self, world_size: int) -> int:
        """Samples per optimizer step over all ranks, the same on any number of them."""
        return self.batch_size * self.grad_accum * (self.started_on or world_size)


class MicroBatch(NamedTuple):
    """One forward and backward on this rank, part of an optimizer step."""

    indices: torch.Tensor  # this rank's samples (a stand-in when it has none)
    weight: float  # on this rank's loss sum: world size / samples in the whole optimizer step (0: stand-in)
    samples: int  # samples in this micro-batch over all ranks


def epoch_steps(num_samples: int, batching: Batching, comm, epoch: int, seed: int) -> list[list[MicroBatch]]:
    """This rank's optimizer steps in one epoch, each a list of its micro-batches.

    `comm` (a ``Communicator``) gives the rank and world size (``rank``, ``world_size``); nothing is communicated.

    The micro-batches of a step together hold the step's slice of the epoch's order,
    and each rank's loss sum is weighted by world size over the step's sample count,
    so that the averaged, accumulated gradient is the mean over the step's samples,
    also in the short step at the end of an epoch. An empty share trains on a
    stand-in with weight 0, because every rank must still take part in the step's
    collectives.
    """
    world, rank = comm.world_size, comm.rank
    order = epoch_order(num_samples, seed, epoch)
    per_step, per_micro = batching.global_batch(world), batching.batch_size * world
    steps = []
    for start in range(0, num_samples, per_step)[:batching.steps_per_epoch or None]:
        end = min(start + per_step, num_samples)
        weight = world / (end - start)
        micro_batches = []
        for first in range(start, end, per_micro):
            last = min(first + per_micro, end)
            mine = order[first + rank:last:world]  # (up to batch_size,) this rank's part
            micro_batches.append(MicroBatch(mine, weight, last - first) if len(mine)
                                 else MicroBatch(torch.zeros(1, dtype=torch.long), 0.0, last - first))
        steps.append(micro_batches)
    return steps


def total_optimizer_steps(num_samples: int, batching: Batching, epochs: int, world: int) -> int:
    """Optimizer steps in the whole run (the learning-rate schedule's length); the same on any number of ranks."""
    per_epoch = math.ceil(num_samples / batching.global_batch(world))
    return epochs * min(per_epoch, batching.steps_per_epoch or per_epoch)


def seed_step(seed: int, step: int, rank: int) -> None:
    """Seeds this rank's random generators for optimizer step `step` of the run: a run resumed at any step draws
    what it would have drawn there uninterrupted on as many ranks, without carrying streams. Dropout does not draw
    from them: its masks follow the sample (fsdp_mpi.use_sample_dropout), on any number of ranks."""
    torch.manual_seed((seed * 1_000_003 + step) * 1009 + rank)

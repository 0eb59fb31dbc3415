"""Which samples each rank trains on: a disjoint, deterministic slice of every epoch.

Each epoch shuffles all sample indices with (seed, epoch); rank r takes every
world_size-th index starting at r, in batches of `batch_size` per step. Across
ranks every sample is used exactly once per epoch: none dropped, none repeated.
Ranks may then hold batches of different sizes (or, at the very end, none), so
each rank weights its loss by its share of the step's global sample count; the
averaged gradient is then exactly that of the global batch. ``epoch_steps`` groups
a rank's batches into optimizer steps of ``grad_accum`` micro-batches each.
"""

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch


def epoch_order(num_samples: int, seed: int, epoch: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def steps_per_epoch(num_samples: int, batch_size: int, world_size: int) -> int:
    """Steps needed for the rank with the most samples (the same number on every rank)."""
    return math.ceil(math.ceil(num_samples / world_size) / batch_size)


def rank_batches(num_samples: int, batch_size: int, rank: int, world_size: int, seed: int, epoch: int) -> list[torch.Tensor]:
    """This rank's sample indices for each step of the epoch; the last ones may be short or empty."""
    mine = epoch_order(num_samples, seed, epoch)[rank::world_size]
    return [mine[step * batch_size:(step + 1) * batch_size] for step in range(steps_per_epoch(num_samples, batch_size, world_size))]


def global_batch_size(num_samples: int, batch_size: int, world_size: int, step: int) -> int:
    """How many samples all ranks together train on at `step` (no communication needed)."""
    total = 0
    for rank in range(world_size):
        rank_samples = len(range(rank, num_samples, world_size))
        total += min(max(rank_samples - step * batch_size, 0), batch_size)
    return total


@dataclass(frozen=True)
class Batching:
    """How an epoch's samples become optimizer steps on each rank."""

    batch_size: int  # samples per rank per micro-batch
    grad_accum: int = 1  # micro-batches per optimizer step
    steps_per_epoch: int = 0  # optimizer steps per epoch; 0: as many as the epoch's samples fill


class MicroBatch(NamedTuple):
    """One forward and backward on this rank, part of an optimizer step."""

    indices: torch.Tensor  # this rank's samples (a stand-in when it has none)
    weight: float  # on this rank's loss sum: world size / samples in the whole optimizer step (0: stand-in)
    samples: int  # samples in this micro-batch over all ranks


def epoch_steps(num_samples: int, batching: Batching, comm, epoch: int, seed: int) -> list[list[MicroBatch]]:
    """This rank's optimizer steps in one epoch, each a list of up to `batching.grad_accum` micro-batches.

    `comm` (a ``Communicator``) gives the rank and world size (``rank``, ``world_size``); nothing is communicated.

    The micro-batches of a step together hold the samples that one batch of
    ``batch_size * grad_accum`` would, and each rank's loss sum is weighted by
    world size over the step's global sample count, so that the averaged,
    accumulated gradient is the mean over the step's samples, also in the short
    steps at the end of an epoch. An empty share trains on a stand-in with weight 0,
    because every rank must still take part in the step's collectives.
    """
    world = comm.world_size
    batches = rank_batches(num_samples, batching.batch_size, comm.rank, world, seed, epoch)
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

"""Which samples each rank trains on: a disjoint, deterministic slice of every epoch.

Each epoch shuffles all sample indices with (seed, epoch); rank r takes every
world_size-th index starting at r, in batches of `batch_size` per step. Across
ranks every sample is used exactly once per epoch: none dropped, none repeated.
Ranks may then hold batches of different sizes (or, at the very end, none), so
each rank weights its loss by its share of the step's global sample count; the
averaged gradient is then exactly that of the global batch.
"""

import math

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

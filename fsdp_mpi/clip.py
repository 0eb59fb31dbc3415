"""Gradient-norm clipping over every rank's shards.

Within a shard group each rank holds a disjoint part of every gradient (its
sharded views' ``.grad``; padding belongs to no view), so the global p-norm is
the p-th root of the sum over the group of each rank's sum of |g|^p, and the
inf-norm the maximum. Replica groups (HYBRID_SHARD, NO_SHARD) hold the same
averaged gradients, so each group finds the same norm on its own.
"""

import math

import torch
from torch import nn

from fsdp_mpi.lifecycle import units_with_names


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scales the gradients of a sharded `model` so that their total norm is at most `max_norm`.

    Returns the total norm before clipping, as ``torch.nn.utils.clip_grad_norm_``
    returns it for the unsharded model, and scales by the same factor
    ``min(1, max_norm / (total_norm + 1e-6))``. Every rank must call it (it reduces).
    """
    units = units_with_names(model)
    if not units:
        raise ValueError("clip_grad_norm_ needs a model that contains a FullyShardedDataParallel unit")
    comm = units[0][1].groups.shard
    norm_type = float(norm_type)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    dtype = grads[0].dtype if grads else torch.float32
    device = grads[0].device if grads else torch.device("cpu")
    nonempty = [g for g in grads if g.numel()]
    if math.isinf(norm_type):
        local = max((g.detach().abs().max().item() for g in nonempty), default=0.0)
        total = comm.allreduce_max_float(local)
    else:
        # Summed in float64: the result does not depend on how the elements were split over ranks.
        local = sum((g.detach().double().abs().pow(norm_type).sum().item() for g in nonempty), 0.0)
        total = comm.allreduce_sum_float(local) ** (1.0 / norm_type)
    total_norm = torch.tensor(total, dtype=dtype, device=device)
    clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(clip_coef.to(grad.dtype))
    return total_norm

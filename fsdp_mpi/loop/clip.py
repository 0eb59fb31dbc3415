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

from fsdp_mpi.sharding.lifecycle import require_units_with_names


def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
    """Scales the gradients of a sharded `model` so that their total norm is at most `max_norm`.

    Returns the total norm before clipping, as ``torch.nn.utils.clip_grad_norm_``
    returns it for the unsharded model, and scales by the same factor
    ``min(1, max_norm / (total_norm + 1e-6))``. Every rank must call it (it reduces).
    """
    units = require_units_with_names(model, "clip_grad_norm_")
    if units[0][1].root.context.stepped_in_backward:
        raise RuntimeError("the optimizer already stepped inside this backward (step_in_backward), with the "
                           "gradients unclipped: clipping needs every gradient before any step, so train with "
                           "optimizer.step() after backward to clip")
    comm = units[0][1].groups.shard
    norm_type = float(norm_type)
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    dtype = grads[0].dtype if grads else torch.float32
    device = grads[0].device if grads else torch.device("cpu")
    nonempty = [g.detach() for g in grads if g.numel()]
    # In float64 on the gradients' device: one rank's norm never leaves it (no host synchronisation),
    # and every rank's part is summed at full precision before the parts are combined.
    if math.isinf(norm_type):
        per_gradient = [g.abs().max().double() for g in nonempty]
        combine, over_ranks = torch.max, comm.all_reduce_max_float
    else:
        per_gradient = [g.double().abs().pow(norm_type).sum() for g in nonempty]
        combine, over_ranks = torch.sum, comm.all_reduce_sum_float
    local = combine(torch.stack(per_gradient)) if per_gradient else torch.zeros((), dtype=torch.float64, device=device)
    total = local if comm.world_size == 1 else over_ranks(local.item())  # one rank: no host synchronisation
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    total_norm = torch.as_tensor(total, device=device).to(dtype)
    clip_coef = (max_norm / (total_norm + 1e-6)).clamp(max=1.0)
    for grad in grads:
        grad.mul_(clip_coef.to(grad.dtype))
    return total_norm


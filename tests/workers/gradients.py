"""Gradients of a sharded model gathered under the original names, and their comparison with one process.

The bound (equivalence.py's check 1): sharding must not be much less accurate than one process, so
||ours - g64|| <= 4 ||fp32 - g64|| + N ulps of ||g64|| (the extra summation over N ranks); per tensor the
same, with a floor of that tensor's share of the whole-model fp32 error (tensors that are pure noise).
"""

import math

import torch
from torch import nn


def full_gradients(model: nn.Module) -> dict[str, torch.Tensor]:
    """A wrapped model's reduced gradients (its sharded views' ``.grad``, as the optimizer reads them, eager or
    compiled), gathered into full tensors on the CPU under the original names (zeros where none)."""
    from fsdp_mpi.sharding.lifecycle import units_with_names
    grads = {}
    for prefix, unit in units_with_names(model):
        for handle in unit.handles:
            if not handle.requires_grad:
                continue
            shard_grad = torch.cat([view.grad if view.grad is not None else torch.zeros_like(view)
                                    for view in handle.sharded_views] + [handle.shard.new_zeros(handle.shard_padding)])
            full = torch.empty(handle.padded_numel, dtype=shard_grad.dtype, device=shard_grad.device)
            handle.comm.all_gather_into(full, shard_grad)
            for slot in handle.slots:
                for use in slot.uses:
                    value = full[slot.offset:slot.offset + slot.numel].view(slot.shape)
                    grads[f"{prefix}.{use.name}" if prefix else use.name] = value.to("cpu", copy=True)
    return grads


def reference_gradients(model: nn.Module, dtype) -> dict[str, torch.Tensor]:
    return {name: (p.grad if p.grad is not None else torch.zeros_like(p)).to("cpu", dtype)
            for name, p in model.named_parameters(remove_duplicate=False) if p.requires_grad}


def compare_gradients(ours: dict, fp32: dict, fp64: dict, world_size: int, u: float) -> dict:
    """`fp32` is the one-process gradient under the same policy, `u` the unit roundoff of its compute dtype."""
    def norm(tensors):
        return math.sqrt(sum(float(t.double().pow(2).sum()) for t in tensors))

    names = sorted(fp64)
    numel = sum(fp64[n].numel() for n in names)
    error32 = norm(fp32[n] - fp64[n] for n in names)
    result = {
        "grad_error": norm(ours[n].double() - fp64[n] for n in names),
        "grad_bound": 4 * error32 + world_size * 2 * u * norm(fp64[n] for n in names),
        "worst_tensor": None, "worst_tensor_ratio": 0.0,
    }
    for n in names:
        error = norm([ours[n].double() - fp64[n]])
        bound = (4 * norm([fp32[n] - fp64[n]]) + world_size * 2 * u * norm([fp64[n]])
                 + 4 * error32 * math.sqrt(fp64[n].numel() / numel))
        if bound == 0.0 or error / bound > result["worst_tensor_ratio"]:
            result["worst_tensor"], result["worst_tensor_ratio"] = n, (error / bound if bound else math.inf)
    return result

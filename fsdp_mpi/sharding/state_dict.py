"""Seeing and saving the full model: gathered parameters under their original names.

The state dicts here contain exactly the keys and shapes of the unwrapped
model's ``state_dict()``, so a trained model can be saved, loaded into the plain
module and used without fsdp_mpi.
"""

from collections import namedtuple
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from fsdp_mpi.sharding.flat_layout import ParamSlot
from fsdp_mpi.sharding.flat_param import FlatParamHandle
from fsdp_mpi.sharding.lifecycle import TrainingState, original_name, require_units_with_names

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


@dataclass(frozen=True)
class ShardedParameter:
    """One original parameter of a wrapped model: its names, where it lives, and this rank's view of it."""

    names: tuple[str, ...]  # original names, more than one for tied parameters
    handle: FlatParamHandle
    slot: ParamSlot
    view: nn.Parameter  # this rank's part, a 1-D slice of handle.shard


def sharded_parameters(module: nn.Module) -> list[ShardedParameter]:
    """Every parameter of every unit in `module`, outermost unit first, in flattening order."""
    return [ShardedParameter(tuple(_join(prefix, use.name) for use in slot.uses), handle, slot, view)
            for prefix, unit in require_units_with_names(module, "sharded_parameters") for handle in unit.handles
            for slot, view in zip(handle.slots, handle.sharded_views)]


def model_comm(module: nn.Module):
    """The communicator of all the model's ranks (a handle's own may be a shard group: HYBRID_SHARD, NO_SHARD)."""
    return require_units_with_names(module, "model_comm")[0][1].comm


def persistent_buffers(module: nn.Module):
    """Yields (original name, buffer) for every buffer that belongs in a state dict."""
    for module_name, submodule in module.named_modules():
        for buffer_name, buffer in submodule._buffers.items():
            if buffer is not None and buffer_name not in submodule._non_persistent_buffers_set:
                yield original_name(_join(module_name, buffer_name)), buffer


@contextmanager
def summon_full_params(module: nn.Module, writeback: bool = True):
    """Gathers every unit's full parameters for the duration of the block.

    Inside it, the wrapped modules' parameter attributes (``model.module.fc.weight``)
    are full tensors in the parameters' own dtype (fp32 masters under mixed
    precision), gathered into buffers of their own. With `writeback`, edits to
    them are kept: each rank copies its own part back into its shard; without
    it, they are discarded. Every rank must enter it together, outside forward
    and backward; it holds the whole model on every rank.
    """
    units = [unit for _, unit in require_units_with_names(module, "summon_full_params")]
    if any(unit.state is not TrainingState.IDLE for unit in units):
        raise RuntimeError("summon_full_params cannot be entered during forward or backward")
    gathered = [(handle, handle.gather_masters()) for unit in units for handle in unit.handles]
    for handle, full in gathered:
        handle.install_full_views(handle.split_full(full))
    try:
        yield module
    finally:
        for handle, full in gathered:
            if writeback:
                handle.write_back_shard(full)
            handle.use_sharded_views()


def full_state_dict(module: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """The unsharded state dict on CPU, gathered one handle at a time to bound memory.

    Every rank must call it. With `rank0_only`, ranks other than 0 get ``{}``
    and keep no copy. Parameters come from the shards, in their own dtype (fp32
    masters under mixed precision). Tied parameters appear under each of their
    names, as in ``nn.Module.state_dict()``.
    """
    units = require_units_with_names(module, "full_state_dict")
    keep = not rank0_only or units[0][1].comm.rank == 0
    state: dict[str, torch.Tensor] = {}
    for prefix, unit in units:
        for handle in unit.handles:
            full = handle.gather_masters()  # every rank takes part
            if keep:
                for slot, tensor in zip(handle.slots, handle.split_full(full)):
                    saved = tensor.to("cpu", copy=True)
                    for use in slot.uses:
                        state[_join(prefix, use.name)] = saved
    if keep:
        for name, buffer in persistent_buffers(module):
            state[name] = buffer.detach().to("cpu", copy=True)
    return state


def load_full_state_dict(module: nn.Module, state_dict: dict, strict: bool = True) -> IncompatibleKeys:
    """Loads a full state dict (original names) that every rank holds; each rank keeps its shard.

    Raises RuntimeError naming missing, unexpected or mis-shaped entries before
    changing anything (missing and unexpected ones only when `strict`).
    """
    # original name -> (handle, slot) or buffer
    targets = {name: (param.handle, param.slot) for param in sharded_parameters(module) for name in param.names}
    for name, buffer in persistent_buffers(module):
        targets[name] = buffer
    missing = sorted(set(targets) - set(state_dict))
    unexpected = sorted(set(state_dict) - set(targets))
    mis_shaped = [
        f"{name}: checkpoint {tuple(state_dict[name].shape)}, model {tuple(_shape_of(targets[name]))}"
        for name in targets
        if name in state_dict and tuple(state_dict[name].shape) != tuple(_shape_of(targets[name]))
    ]
    problems = []
    if strict and missing:
        problems.append("missing keys: " + ", ".join(missing))
    if strict and unexpected:
        problems.append("unexpected keys: " + ", ".join(unexpected))
    if mis_shaped:
        problems.append("shape mismatches: " + "; ".join(mis_shaped))
    if problems:
        raise RuntimeError("cannot load state dict: " + " | ".join(problems))

    with torch.no_grad():
        for name, target in targets.items():
            if name not in state_dict:
                continue
            if isinstance(target, torch.Tensor):
                target.copy_(state_dict[name])
            else:
                target[0].copy_into_shard(target[1], state_dict[name])
    return IncompatibleKeys(missing, unexpected)


def _shape_of(target) -> torch.Size:
    return target.shape if isinstance(target, torch.Tensor) else target[1].shape


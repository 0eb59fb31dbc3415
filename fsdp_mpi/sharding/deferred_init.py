"""Deferred initialisation: a model built on the ``meta`` device is materialised straight into shards.

    with torch.device("meta"):
        model = GPT2LMHeadModel(config)          # shapes only: no memory, no random numbers drawn
    model = FullyShardedDataParallel(model, auto_wrap_policy=..., param_init_fn=model.init_module)

Wrapping lays out the flat buffers from the parameters' shapes alone and gives
each rank a zero shard. Then every module that owns parameters directly is
visited in ``model.modules()`` order (pre-order, registration order). Its own
parameters are shadowed by full-size tensors, ``param_init_fn(module)`` (or
``module.reset_parameters()``) fills them, each rank copies the part it keeps
into its shard, and the full tensors are dropped. Memory while wrapping is the
shards plus one module's own parameters.

Why the weights do not depend on the number of ranks, and equal eager
construction: every rank draws the same random numbers in the same order, for
whole tensors, and keeps a slice; the order is the one eager construction uses
when a model initialises itself as ``for m in self.modules(): init(m)`` (ours
do, and build their modules on ``meta`` first so that construction draws
nothing). With ``sync_module_states`` every rank starts from rank 0's random
generator state, so ranks seeded differently still agree.
"""

import torch
from torch import nn

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.sharding.lifecycle import ShardedUnit


def is_deferred(module: nn.Module) -> bool:
    """Whether `module`'s parameters are on the meta device (all or none of them may be)."""
    on_meta = {param.is_meta for param in module.parameters()}
    if on_meta == {True, False}:
        meta = [name for name, param in module.named_parameters() if param.is_meta]
        raise ValueError(f"some parameters are on the meta device ({', '.join(meta[:5])}, ...) and some are not; "
                         "build the whole model on meta (deferred initialisation) or none of it")
    if on_meta == {True}:
        meta_buffers = [name for name, buffer in module.named_buffers() if buffer.is_meta]
        if meta_buffers:
            raise ValueError(
                f"buffers {', '.join(meta_buffers)} are on the meta device: deferred initialisation materialises "
                "parameters only; create buffers on a real device (e.g. torch.arange(n, device='cpu'))")
    return on_meta == {True}


def materialize_into_shards(module: nn.Module, units: list[ShardedUnit], param_init_fn, comm: Communicator,
                            sync_rng_state: bool) -> None:
    """Fills every unit's shard by initialising `module`'s parameters one module at a time (see above)."""
    if sync_rng_state:
        torch.set_rng_state(comm.all_gather_object(torch.get_rng_state())[0])
        if any(handle.shard.is_cuda for unit in units for handle in unit.handles):
            torch.cuda.set_rng_state(comm.all_gather_object(torch.cuda.get_rng_state())[0])
    where = {id(view): (handle, slot)
             for unit in units for handle in unit.handles for slot, view in zip(handle.slots, handle.sharded_views)}
    handles = [handle for unit in units for handle in unit.handles]
    for submodule in module.modules():
        own = [(attribute, view) for attribute, view in submodule._parameters.items() if view is not None]
        if own:
            _initialise(submodule, own, where, handles, param_init_fn)


def _initialise(module: nn.Module, own: list, where: dict, handles: list, param_init_fn) -> None:
    init = param_init_fn
    if init is None:
        if not hasattr(module, "reset_parameters"):
            raise TypeError(f"{type(module).__name__} has parameters but no reset_parameters(): pass "
                            "param_init_fn=... to FullyShardedDataParallel to initialise it on the meta device")
        init = type(module).reset_parameters
    full = {}
    for attribute, view in own:
        handle, slot = where[id(view)]
        full[attribute] = nn.Parameter(torch.empty(slot.shape, dtype=handle.shard.dtype, device=handle.shard.device),
                                       requires_grad=view.requires_grad)
        module.__dict__[attribute] = full[attribute]  # shadows the sharded view while `init` runs
    versions = [handle.shard._version for handle in handles]
    try:
        with torch.no_grad():
            init(module)
    finally:
        for attribute, _ in own:
            module.__dict__.pop(attribute, None)
    changed = [handle for handle, version in zip(handles, versions) if handle.shard._version != version]
    if changed:
        raise RuntimeError(f"initialising {type(module).__name__} changed parameters it does not own directly; "
                           "param_init_fn(module) must initialise only module's own parameters (recurse=False), "
                           "since those of its submodules are sharded at that point")
    for attribute, view in own:
        value = full[attribute]
        if module._parameters[attribute] is not view:  # `init` assigned a new Parameter: take its value
            value, module._parameters[attribute] = module._parameters[attribute], view
        handle, slot = where[id(view)]
        handle.copy_into_shard(slot, value)

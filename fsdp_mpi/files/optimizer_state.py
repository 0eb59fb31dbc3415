"""An optimizer's state by parameter name, so that it leaves and enters the sharded views whole or in pieces.

A rank's optimizer holds, for each sharded view (``state_dict.ShardedParameter.view``), state of two kinds:
per-element tensors shaped like the view (Adam's ``exp_avg``), which are pieces of the whole parameter's, and
scalars (``step``), the same for every piece. Sharded checkpoints save the pieces by element range
(``checkpoint.py``); a full optimizer state holds them whole, in the form ``consolidate_checkpoint`` gives:

    {"state": {name: {"exp_avg": tensor shaped like the parameter, "step": tensor(3.), ...}, ...},
     "param_groups": [{"lr": 0.1, ..., "params": [name, ...]}, ...]}

so that it is read by name, on any number of ranks, with any wrap policy (a Lightning checkpoint of one file).
"""

from collections.abc import Callable

import torch
from torch import nn

from fsdp_mpi.sharding.state_dict import ShardedParameter, model_comm, sharded_parameters


class OptimizerStateError(ValueError):
    """An optimizer's state that cannot be sharded, or that does not fit the optimizer it is loaded into."""


def split_optimizer_state(optimizer, params: list[ShardedParameter]) -> tuple[dict, dict]:
    """This rank's optimizer state by name: ``({"optim/<name>/<key>": per-element tensor}, {"param_groups": groups
    with names for parameters, "scalars": {name: {key: value}}, "keys": {name: [per-element key, ...]}})``."""
    name_of = {id(p.view): p.names[0] for p in params}
    view_of = {p.names[0]: p.view for p in params}
    ordered = [param for group in optimizer.param_groups for param in group["params"]]
    strangers = [i for i, param in enumerate(ordered) if id(param) not in name_of]
    if strangers:
        raise OptimizerStateError(f"the optimizer holds {len(strangers)} parameters that are not the wrapped "
                                  "model's sharded views; build it from model.parameters() after wrapping")
    saved = optimizer.state_dict()
    tensors, scalars, keys = {}, {}, {}
    for index, state in saved["state"].items():
        name = name_of[id(ordered[index])]
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape == view_of[name].shape:
                tensors[f"optim/{name}/{key}"] = value
                keys.setdefault(name, []).append(key)
            elif isinstance(value, (int, float, bool)) or (isinstance(value, torch.Tensor) and value.dim() == 0):
                scalars.setdefault(name, {})[key] = value.cpu() if isinstance(value, torch.Tensor) else value
            else:
                raise OptimizerStateError(f"optimizer state {key!r} of {name} is neither one value per element nor "
                                          f"a scalar ({type(value).__name__} {getattr(value, 'shape', '')}); it "
                                          "cannot be sharded")
    groups = [{**{k: v for k, v in group.items() if k != "params"},
               "params": [name_of[id(ordered[i])] for i in group["params"]]} for group in saved["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars, "keys": keys}


def state_for_views(optimizer, params: list[ShardedParameter], saved: dict,
                    read: Callable[[str, int, int, str], torch.Tensor]) -> dict:
    """The optimizer's ``state_dict()`` for this rank's views, from state saved by name.

    `saved`: ``{"param_groups", "scalars", "keys"}`` as ``split_optimizer_state`` gives them (whole or from any
    number of ranks); ``read(name, start, stop, key)``: elements [start, stop) of a parameter's flattened
    per-element state `key`, 1-D.
    """
    name_of = {id(p.view): p for p in params}
    ordered = [param for group in optimizer.param_groups for param in group["params"]]
    if len(optimizer.param_groups) != len(saved["param_groups"]):
        raise OptimizerStateError(f"the optimizer has {len(optimizer.param_groups)} parameter groups, the saved "
                                  f"state {len(saved['param_groups'])}")
    groups, position = [], 0
    for number, (group, saved_group) in enumerate(zip(optimizer.param_groups, saved["param_groups"])):
        names = [name_of[id(param)].names[0] for param in group["params"]]
        if set(names) != set(saved_group["params"]):
            raise OptimizerStateError(f"parameter group {number} holds other parameters than the saved state: "
                                      + ", ".join(sorted(set(names) ^ set(saved_group["params"]))[:10]))
        groups.append({**saved_group, "params": list(range(position, position + len(names)))})
        position += len(names)
    states = {}
    for index, param in enumerate(ordered):
        sharded = name_of[id(param)]
        name = sharded.names[0]
        keys = saved["keys"].get(name, [])
        if name not in saved["scalars"] and not keys:
            continue  # never stepped
        start, stop = sharded.handle.part_held(sharded.slot)
        states[index] = {**saved["scalars"].get(name, {}), **{key: read(name, start, stop, key) for key in keys}}
    return {"state": states, "param_groups": groups}


def full_optimizer_state_dict(model: nn.Module, optimizer, rank0_only: bool = True) -> dict:
    """The whole optimizer state on CPU, by parameter name (the module's docstring shows its form).

    Every rank must call it. Each per-element state is gathered one handle at a time, as ``full_state_dict``
    gathers the weights. With `rank0_only`, ranks other than 0 get ``{}`` and keep no copy.
    """
    params = sharded_parameters(model)
    comm = model_comm(model)
    pieces, split = split_optimizer_state(optimizer, params)
    # A rank that holds no element of a parameter may hold no state for it: every rank's keys and scalars.
    keys, scalars = {}, {}
    for rank_keys, rank_scalars, rank_dtypes in comm.all_gather_object(
            (split["keys"], split["scalars"], {name: str(value.dtype) for name, value in pieces.items()})):
        for name, names_keys in rank_keys.items():
            for key in names_keys:
                keys.setdefault(name, {}).setdefault(key, rank_dtypes[f"optim/{name}/{key}"])
        for name, values in rank_scalars.items():
            scalars.setdefault(name, values)
    keep = not rank0_only or comm.rank == 0
    state = {name: dict(values) for name, values in scalars.items()} if keep else {}
    for handle in dict.fromkeys(p.handle for p in params):  # in order, each once
        held = [p for p in params if p.handle is handle]
        for key, dtype in _keys_of(held, keys):
            shard = torch.zeros(handle.shard_numel, dtype=dtype, device=handle.shard.device)
            for p in held:
                piece = pieces.get(f"optim/{p.names[0]}/{key}")
                if piece is not None:
                    shard[p.slot.shard_start:p.slot.shard_stop].copy_(piece)
            full = torch.empty(handle.padded_numel, dtype=dtype, device=handle.shard.device)
            handle.comm.all_gather_into(full, shard, handle.unit_name)  # every rank takes part
            if keep:
                for p, whole in zip(held, handle.split_full(full)):  # one parameter per slot, in slot order
                    if key in keys.get(p.names[0], {}):
                        state.setdefault(p.names[0], {})[key] = whole.to("cpu", copy=True)
    return {"state": state, "param_groups": split["param_groups"]} if keep else {}


def _keys_of(held: list[ShardedParameter], keys: dict) -> list[tuple[str, torch.dtype]]:
    """The per-element keys any of a handle's parameters has, each with its dtype, in a first-seen order."""
    found = {}
    for p in held:
        for key, dtype in keys.get(p.names[0], {}).items():
            found.setdefault(key, getattr(torch, dtype.removeprefix("torch.")))
    return list(found.items())


def load_full_optimizer_state_dict(model: nn.Module, optimizer, full: dict) -> None:
    """Loads a full optimizer state (every rank holds it, by name) into `optimizer`: each rank keeps its pieces.

    Checks every name and shape before changing anything (``OptimizerStateError`` naming what does not fit).
    """
    params = sharded_parameters(model)
    shapes = {p.names[0]: p.slot.shape for p in params}
    keys, scalars, problems = {}, {}, []
    for name, values in full["state"].items():
        if name not in shapes:
            problems.append(f"{name}: not a parameter of the model")
            continue
        for key, value in values.items():
            if isinstance(value, torch.Tensor) and value.dim() >= 1:
                if value.shape != shapes[name]:
                    problems.append(f"{name} {key}: {tuple(value.shape)}, the parameter {tuple(shapes[name])}")
                keys.setdefault(name, []).append(key)
            else:
                scalars.setdefault(name, {})[key] = value
    if problems:
        raise OptimizerStateError("the optimizer state does not fit this model: " + "; ".join(problems[:10]))
    saved = {"param_groups": full["param_groups"], "scalars": scalars, "keys": keys}
    optimizer.load_state_dict(state_for_views(
        optimizer, params, saved, lambda name, start, stop, key: full["state"][name][key].reshape(-1)[start:stop]))

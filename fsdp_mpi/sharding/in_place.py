"""Sharded in place: ``.to()``, ``.cuda()``, ``.half()``, ``.to_empty()``... on a unit's modules are refused
where they would change its parameters.

Each parameter of a unit is a view into the unit's flat shard, which every gather
reads and the optimizer steps. Moving or casting a module gives each view data
of its own, apart from the shard: a cast fails at the first gradient deep in
autograd, and ``to_empty()`` trains on with weights that never move. So every
module of a unit (its module and the parts inside it, on whichever one the call
starts: the wrapper, ``model.module``, ``model.module.encoder.layer``) checks
what the call would do to the shards of the parameters below it first, and
passes the call on only where it changes nothing (the device and dtype they are
on already).
"""

import types

from torch import nn

from fsdp_mpi.sharding.flat_param import FlatParamHandle

_HANDLES_ATTRIBUTE = "_fsdp_mpi_handles"  # in a guarded module's __dict__: its unit's handles


def refuse_moving_or_casting(modules: list[nn.Module], handles: list[FlatParamHandle]) -> None:
    """Guards each of `modules` (one unit's) so that a move or cast of its parameters raises."""
    for module in modules:
        module.__dict__[_HANDLES_ATTRIBUTE] = handles
        # A method bound to this module: a copy of the model (copy.deepcopy) binds its own.
        module._apply = types.MethodType(_apply_unless_it_parts_shards, module)


def _apply_unless_it_parts_shards(module: nn.Module, fn, *args, **kwargs):
    """``nn.Module._apply`` (what ``.to()`` and its kin call with `fn`), after checking every shard under
    `module` against `fn`. The rest of the call is passed on as it came: a subclass may take other arguments
    (torchmetrics' ``Metric._apply(fn, exclude_state)``)."""
    below = set(module.modules())
    for handle in module.__dict__[_HANDLES_ATTRIBUTE]:
        if any(use.owner in below for slot in handle.slots for use in slot.uses):
            probe = handle.shard[:1]
            if fn(probe) is not probe:
                raise RuntimeError(
                    f"{type(module).__name__} is sharded in place: moving or casting it after wrapping would part "
                    "its parameters from their shards. Move it before wrapping, or pass device= to "
                    "FullyShardedDataParallel; compute in another dtype with mixed_precision=MixedPrecision(...)")
    return type(module)._apply(module, fn, *args, **kwargs)

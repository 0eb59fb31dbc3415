"""FullyShardedDataParallel: one sharding unit and its lifecycle.

A unit owns the parameters of its wrapped module that are not inside a nested
unit. Its lifecycle in one training step::

    forward:   unshard (all-gather) -> module.forward -> reshard (free)
    backward:  first gradient reaches an output -> unshard again
               autograd finishes the unit's gradient -> reduce-scatter -> reshard
    end of backward (root only): reduce what got no gradient, reshard what is left

so at any moment a rank holds its shards plus the full parameters of the units
that are computing. The outermost unit is the root; it owns the end-of-backward
step and the recorded execution order for the whole tree.

Optional overlap (each off by default, see docs/design.md): ``forward_prefetch``
starts gathering the next unit when a unit's forward starts, ``backward_prefetch``
does the same in backward, and ``async_reduce_scatter`` lets a unit's gradient
reduction run on while the earlier units' backward goes on (one in flight).
"""

from enum import Enum, auto

import torch
from torch import nn
from torch.autograd import Variable

from fsdp_mpi.abort import abort_job_on_uncaught_exception
from fsdp_mpi.comm import Communicator
from fsdp_mpi.execution_order import ExecutionOrder
from fsdp_mpi.flat_param import OWNER_ATTRIBUTE, FlatParamHandle, ParamUse
from fsdp_mpi.host_memory import keep_freed_host_memory_for_reuse
from fsdp_mpi.strategy import ShardingStrategy
from fsdp_mpi.validation import check_module_can_be_sharded, check_same_model_on_all_ranks
from fsdp_mpi.wrap import apply_wrap_policy

WRAPPED_MODULE = "_fsdp_wrapped_module"


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()  # inside this unit's forward
    BACKWARD = auto()  # gathered for backward, gradient not yet reduced


class FullyShardedDataParallel(nn.Module):
    """Shards `module`'s parameters, gradients and optimizer state over the ranks of `comm`.

    Args:
        module: the model (or part of it) to shard. It must be built identically on every rank.
        comm: an mpi4py communicator or a ``fsdp_mpi.Communicator``; ``MPI.COMM_WORLD`` by default.
        auto_wrap_policy: e.g. ``ModuleWrapPolicy({Block})``: which submodules become nested units.
        sharding_strategy: ``FULL_SHARD`` (default) or ``SHARD_GRAD_OP``.
        device: where the unit computes; the module is moved there. Defaults to the parameters' device.
        sync_module_states: broadcast rank 0's parameters and buffers first, so every rank starts identical.
        forward_prefetch: start the next unit's all-gather when a unit's forward starts.
        backward_prefetch: start the all-gather of the unit whose backward comes next.
        async_reduce_scatter: let a unit's gradient reduce-scatter complete while earlier units' backward runs.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        comm=None,
        auto_wrap_policy=None,
        sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
        device: torch.device | str | int | None = None,
        sync_module_states: bool = True,
        forward_prefetch: bool = False,
        backward_prefetch: bool = False,
        async_reduce_scatter: bool = False,
        _nested_in_wrap: bool = False,
    ):
        super().__init__()
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError("this module is already wrapped by FullyShardedDataParallel; wrap it only once")
        if not isinstance(sharding_strategy, ShardingStrategy):
            raise TypeError(f"sharding_strategy must be a ShardingStrategy, got {sharding_strategy!r}")
        device = torch.device(device) if isinstance(device, (str, int)) else device
        check_module_can_be_sharded(module, device)
        self._comm = comm if isinstance(comm, Communicator) else Communicator(comm)
        self._sharding_strategy = sharding_strategy
        self._overlap = {"forward_prefetch": forward_prefetch, "backward_prefetch": backward_prefetch,
                         "async_reduce_scatter": async_reduce_scatter}
        if device is not None:
            module.to(device)

        if not _nested_in_wrap:
            if self._comm.world_size > 1:
                abort_job_on_uncaught_exception(self._comm.mpi_comm)
            if next(module.parameters()).device.type == "cpu":
                keep_freed_host_memory_for_reuse()
            check_same_model_on_all_ranks(module, self._comm)
            if sync_module_states:
                _broadcast_module_states(module, self._comm)
        if auto_wrap_policy is not None:
            apply_wrap_policy(module, auto_wrap_policy, self._wrap_nested, FullyShardedDataParallel)

        self.add_module(WRAPPED_MODULE, module)
        unit_name = type(module).__name__
        self._handles = [FlatParamHandle(group, self._comm, unit_name) for group in _group_unit_params(module)]
        for index, handle in enumerate(self._handles):
            self.register_parameter(f"flat_param_{index}", handle.flat_param)
            if handle.requires_grad:
                handle.full_flat.register_post_accumulate_grad_hook(
                    lambda _full_flat, handle=handle: self._post_backward(handle)
                )
        self._state = TrainingState.IDLE

        # This unit is the root until an outer unit wraps it; the root knows every unit below it.
        self._units = [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
        for unit in self._units:
            # object.__setattr__: a Module attribute set normally would register the root as a child.
            object.__setattr__(unit, "_root", self)
        self._end_of_backward_queued = False
        self._execution_order = ExecutionOrder()
        self._reduction_in_flight: FlatParamHandle | None = None

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return getattr(self, WRAPPED_MODULE)

    @property
    def is_root(self) -> bool:
        return self._root is self

    @property
    def handles(self) -> list[FlatParamHandle]:
        """This unit's flat parameter handles (one per dtype and requires_grad group)."""
        return self._handles

    @property
    def training_state(self) -> TrainingState:
        return self._state

    def _wrap_nested(self, child: nn.Module) -> "FullyShardedDataParallel":
        return FullyShardedDataParallel(
            child, comm=self._comm, sharding_strategy=self._sharding_strategy, **self._overlap, _nested_in_wrap=True
        )

    # ----------------------------------------------------------------- forward

    def forward(self, *args, **kwargs):
        if self._state is TrainingState.BACKWARD:
            # Activation checkpointing re-runs a forward during backward: parameters are already gathered.
            return self.module(*args, **kwargs)
        if self.is_root:
            self._root_pre_forward()
        order = self._root._execution_order
        order.record(self)
        self._unshard()
        if self._overlap["forward_prefetch"] and (upcoming := order.after(self)) is not None:
            upcoming._start_unshard()
        for handle in self._handles:
            handle.point_attributes_at_full_flat()
        self._state = TrainingState.FORWARD
        try:
            output = self.module(*args, **kwargs)
        finally:
            self._state = TrainingState.IDLE
        if self.is_root:
            order.stop_recording()
        backward_follows = torch.is_grad_enabled()
        if backward_follows:
            for handle in self._handles:
                handle.awaiting_gradient = handle.requires_grad
            _register_on_output_tensors(output, self._pre_backward)
        # The root's parameters are needed first thing in backward, so it keeps them gathered then.
        keep_for_backward = self._sharding_strategy is ShardingStrategy.SHARD_GRAD_OP or self.is_root
        if not (backward_follows and keep_for_backward):
            self._reshard()
        return output

    def _root_pre_forward(self) -> None:
        """Clears what an abandoned step (a forward with no backward) may have left."""
        self._finish_reduction_in_flight()
        for unit in self._units:
            if unit._state is not TrainingState.IDLE:
                unit._reshard()
                unit._state = TrainingState.IDLE
            for handle in unit._handles:
                handle.awaiting_gradient = False

    # ----------------------------------------------------------------- backward

    def _pre_backward(self, _grad: torch.Tensor) -> None:
        """Runs when the gradient of one of this unit's outputs is ready: gather for backward."""
        self._root._queue_end_of_backward()
        if self._state is not TrainingState.BACKWARD:
            self._unshard()
            self._state = TrainingState.BACKWARD
            if self._overlap["backward_prefetch"] and (upcoming := self._root._execution_order.before(self)):
                upcoming._start_unshard()

    def _post_backward(self, handle: FlatParamHandle) -> None:
        """Runs when autograd has summed every use's gradient into ``handle.full_flat.grad``."""
        asynchronous = self._overlap["async_reduce_scatter"]
        if asynchronous:
            self._root._finish_reduction_in_flight()  # at most one in flight bounds the gradient memory held
        handle.reduce_gradient(asynchronous=asynchronous)
        if asynchronous:
            self._root._reduction_in_flight = handle
        if not any(h.awaiting_gradient for h in self._handles):
            self._reshard()
            self._state = TrainingState.IDLE

    def _queue_end_of_backward(self) -> None:
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Reduces gradients that never arrived (unused units or outputs) and frees everything.

        Runs in the same unit order on every rank, so ranks stay in step even when
        some unit's parameters took no part in this backward.
        """
        self._finish_reduction_in_flight()
        for unit in self._units:
            for handle in unit._handles:
                if handle.awaiting_gradient:
                    handle.reduce_gradient()
            unit._reshard()
            unit._state = TrainingState.IDLE
        self._end_of_backward_queued = False

    def _finish_reduction_in_flight(self) -> None:
        if self._reduction_in_flight is not None:
            self._reduction_in_flight.finish_gradient_reduction()
            self._reduction_in_flight = None

    # ----------------------------------------------------------------- gather / free

    def _unshard(self) -> None:
        for handle in self._handles:
            handle.unshard()

    def _start_unshard(self) -> None:
        for handle in self._handles:
            handle.start_unshard()

    def _reshard(self) -> None:
        for handle in self._handles:
            handle.reshard()

    # ----------------------------------------------------------------- state dicts

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The full, unsharded state dict with the original parameter names, on rank 0 only.

        Other ranks get an empty dict. Every rank must call it (it gathers).
        """
        from fsdp_mpi.state_dict import full_state_dict

        state = full_state_dict(self, rank0_only=True)
        destination = {} if destination is None else destination
        destination.update({prefix + name: tensor for name, tensor in state.items()})
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a full state dict (original names) given on every rank; each rank keeps its shard."""
        from fsdp_mpi.state_dict import load_full_state_dict

        return load_full_state_dict(self, state_dict, strict=strict)


FSDP = FullyShardedDataParallel


def _group_unit_params(module: nn.Module) -> list[list[tuple[nn.Parameter, list[ParamUse]]]]:
    """The unit's own parameters (not those of nested units), grouped by dtype and requires_grad.

    A parameter used in several places (tied weights) appears once, with all its uses.
    Order follows module registration order, which is the same on every rank.
    """
    uses_by_param: dict[int, tuple[nn.Parameter, list[ParamUse]]] = {}
    for module_name, submodule in _modules_outside_nested_units(module):
        for attribute, param in submodule._parameters.items():
            if param is None:
                continue
            name = f"{module_name}.{attribute}" if module_name else attribute
            owner = getattr(param, OWNER_ATTRIBUTE, None)
            if owner is not None:
                raise ValueError(
                    f"parameter {name!r} is shared with a parameter already sharded by the unit "
                    f"wrapping a {owner}; shared (tied) parameters must belong to one unit: "
                    "change the wrap policy so that every use lies in the same unit"
                )
            uses_by_param.setdefault(id(param), (param, []))[1].append(ParamUse(name, submodule, attribute))
    groups: dict[tuple, list] = {}
    for param, uses in uses_by_param.values():
        groups.setdefault((param.dtype, param.requires_grad), []).append((param, uses))
    return list(groups.values())


def _modules_outside_nested_units(module: nn.Module, prefix: str = "", seen: set | None = None):
    """Yields (name, submodule) for `module` and its descendants, not entering nested units."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    yield prefix, module
    for name, child in module.named_children():
        if not isinstance(child, FullyShardedDataParallel):
            yield from _modules_outside_nested_units(child, f"{prefix}.{name}" if prefix else name, seen)


def _broadcast_module_states(module: nn.Module, comm: Communicator) -> None:
    """Copies rank 0's parameters and buffers (outside nested units) to every rank."""
    with torch.no_grad():
        for _, submodule in _modules_outside_nested_units(module):
            for tensor in [*submodule._parameters.values(), *submodule._buffers.values()]:
                if tensor is not None:
                    comm.broadcast_(tensor.data)


def _register_on_output_tensors(output, hook) -> None:
    """Registers `hook` on every tensor in `output` (nested tuples, lists, dicts) that needs a gradient."""
    if isinstance(output, torch.Tensor):
        if output.requires_grad:
            output.register_hook(hook)
    elif isinstance(output, (tuple, list)):
        for item in output:
            _register_on_output_tensors(item, hook)
    elif isinstance(output, dict):
        for item in output.values():
            _register_on_output_tensors(item, hook)

"""One sharding unit's lifecycle, driven by hooks on the module it shards.

A unit owns the parameters of its module that are not inside a nested unit. Its
lifecycle in one training step::

    forward pre-hook:   unshard (all-gather), point parameter attributes at full views
    module.forward      (nested units do the same inside)
    forward hook:       reshard (free), hook the outputs for backward
    backward:           first gradient reaches an output -> unshard again
                        autograd finishes the unit's gradient -> reduce-scatter -> reshard
    end of backward (root only): reduce what got no gradient, reshard what is left,
                        and set .grad = None where no rank used a parameter (one small all-reduce)

so at any moment a rank holds its shards plus the full parameters of the units
that are computing. Because the hooks sit on the module itself, it computes
correctly however it is called: through the ``FullyShardedDataParallel``
wrapper, through its own ``__call__`` (a Hugging Face ``generate()``), nested or
alone, with or without gradients. The modules inside a unit (its *parts*) carry
the same hooks, which act only while the unit is not computing: a part called on
its own (an encoder that ``generate()`` calls, ``model.encoder(x)``, one tower of
a retrieval model) gathers its unit around that call exactly as the unit's own
forward would, and backward follows it the same way. The outermost unit is the
root; it owns the end-of-backward step, and the tree's bookkeeping (every unit,
the recorded execution order, the reduction in flight) lives in its
``RootContext`` (``root_context.py``), which every unit reads through its root.
Inside ``step_in_backward`` the context also hands each reduced gradient to the
optimizer's step (``loop/step_in_backward.py``).

Under mixed precision (``mixed_precision.py``) the pre-hook also casts the
forward's floating-point inputs to ``param_dtype``; gathering and reducing in
other dtypes is the handles' business.

Code that ``torch.compile`` traces takes another path through the same handles:
the wrapper's hooks gather through custom operators in the graph, whose backward
reduces (``traced.py``), and the unit's hooks stand aside until the module
returns. Hooks that dynamo meets as frames of their own (``torch.compile(model)``
runs the compiled module's hooks outside its frame) run eagerly: compiled whole,
the root gathers and reduces around the graph, as in an eager step.

Optional overlap (each off by default, see docs/communication.md#overlap): ``forward_prefetch``
starts gathering the next unit when a unit's forward starts, ``backward_prefetch``
does the same in backward, and ``async_reduce_scatter`` lets a unit's gradient
reduction run on while the earlier units' backward goes on (one in flight).
"""

import weakref
from dataclasses import dataclass
from enum import Enum, auto

import torch
from torch import nn

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.compression import Compression
from fsdp_mpi.communication.timing_points import HOOK, timed
from fsdp_mpi.sharding.flat_layout import group_parameters
from fsdp_mpi.sharding.flat_param import FlatParamHandle
from fsdp_mpi.sharding.offload import CPUOffload
from fsdp_mpi.sharding.in_place import refuse_moving_or_casting
from fsdp_mpi.sharding.mixed_precision import MixedPrecision, cast_floating_tensors
from fsdp_mpi.sharding.nested import for_each_tensor
from fsdp_mpi.sharding.root_context import RootContext
from fsdp_mpi.sharding.strategy import ShardGroups, ShardingStrategy
from fsdp_mpi.sharding.traced import eager_as_a_frame_of_its_own, register, untraced

# The unit of a sharded module, kept in the module's __dict__ (not a registered submodule).
UNIT_ATTRIBUTE = "_fsdp_mpi_unit"
# The name under which a FullyShardedDataParallel wrapper holds its module; not part of user-facing names.
WRAPPED_MODULE = "_fsdp_wrapped_module"


class TrainingState(Enum):
    IDLE = auto()
    FORWARD = auto()  # inside this unit's forward
    BACKWARD = auto()  # gathered for backward, gradient not yet reduced


def original_name(name: str) -> str:
    """``_fsdp_wrapped_module.h.0._fsdp_wrapped_module.attn.weight`` -> ``h.0.attn.weight``."""
    return ".".join(part for part in name.split(".") if part and part != WRAPPED_MODULE)


def units_with_names(module: nn.Module) -> list[tuple[str, "ShardedUnit"]]:
    """Every unit in `module`, outermost first, with its module's original name ("" for the top)."""
    return [(original_name(name), sub.__dict__[UNIT_ATTRIBUTE])
            for name, sub in module.named_modules() if UNIT_ATTRIBUTE in sub.__dict__]


def require_units_with_names(module: nn.Module, needed_by: str) -> list[tuple[str, "ShardedUnit"]]:
    """``units_with_names(module)``, which must not be empty: ValueError naming `needed_by` otherwise."""
    units = units_with_names(module)
    if not units:
        raise ValueError(f"{needed_by} needs a model that contains a FullyShardedDataParallel unit; "
                         "wrap it (or its blocks) first")
    return units


@dataclass(frozen=True)
class Overlap:
    """Which of the optional overlaps a unit uses (the module's docstring; each off by default): named fields,
    so that a switch misspelt fails where it is made, not when a hook first reads it."""

    forward_prefetch: bool = False
    backward_prefetch: bool = False
    async_reduce_scatter: bool = False


class ShardedUnit:
    """Flattens `module`'s own parameters into shards and gathers them whenever `module` computes.

    Args:
        module: the module to shard; nested units inside it must exist already.
        comm: every rank of the model.
        groups: the shard group and replica group of this rank under the strategy (``strategy.ShardGroups``).
        sharding_strategy: a ``ShardingStrategy``.
        overlap: which optional overlaps are on (``Overlap``).
        mixed_precision: the dtypes to gather, compute and reduce in.
        compression: how gathered weights and reduced gradients travel (None: uncompressed).
        device: where the unit computes (None: where its parameters are); where shards of parameters on the
            meta device are created (deferred initialisation), unless offloaded.
        cpu_offload: where the shards live (``offload.py``); None: on `device`.
    """

    def __init__(self, module: nn.Module, comm: Communicator, groups: ShardGroups, sharding_strategy: ShardingStrategy,
                 overlap: Overlap, mixed_precision: MixedPrecision, device: torch.device | None = None,
                 compression: Compression | None = None, cpu_offload: CPUOffload | None = None):
        self.module = module
        self.comm = comm
        self.groups = groups
        self.sharding_strategy = sharding_strategy
        self.overlap = overlap
        self.mixed_precision = mixed_precision
        unit_name = type(module).__name__
        self.handles = [FlatParamHandle(params, groups.shard, unit_name, mixed_precision.param_dtype,
                                        mixed_precision.reduce_dtype, device, groups.replicas, compression,
                                        cpu_offload)
                        for params in group_parameters(modules_outside_units(module))]
        for handle in self.handles:
            handle.traced_id = register(handle, _queue_end_of_backward(self))
            if handle.requires_grad:
                handle.full_flat.register_post_accumulate_grad_hook(_post_backward_hook(self, handle))
        self.state = TrainingState.IDLE
        # False inside no_sync(): gradients stay unsharded and accumulate until a backward with sync.
        self.requires_gradient_sync = True
        module.__dict__[UNIT_ATTRIBUTE] = self
        module.register_forward_pre_hook(self._pre_forward, prepend=True, with_kwargs=True)
        module.register_forward_hook(self._post_forward)
        self._called_alone: nn.Module | None = None  # the part whose own call gathered this unit, if any
        self.gathered_in_graph = False  # the wrapper's hooks gathered it in a graph: its hooks stand aside
        parts = _parts(module)
        for part in parts:
            part.register_forward_pre_hook(self._pre_forward_of_part, prepend=True, with_kwargs=True)
            part.register_forward_hook(self._post_forward_of_part)
        refuse_moving_or_casting([module, *parts], self.handles)

        # This unit is the root until an outer unit is built around it; the root's context knows every unit
        # below it, and the units below it drop the contexts they held as roots. Whether a unit keeps its
        # weights for backward, and so where its buffers come from, is known only now.
        named_units = units_with_names(module)
        for name, unit in named_units:
            unit.root, unit.context = self, None
            for handle in unit.handles:
                handle.unit_name = name or "<root>"
                handle.reuse_buffers(comes_back=not unit.keeps_gathered_for_backward)
        self.context: RootContext | None = RootContext([unit for _, unit in named_units])  # the root's only

    @property
    def is_root(self) -> bool:
        return self.root is self

    @property
    def keeps_gathered_for_backward(self) -> bool:
        """Whether forward's gathered weights stay for backward: SHARD_GRAD_OP's, and the root's (needed first
        thing in backward); every other unit gathers again."""
        return self.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP or self.is_root

    # ----------------------------------------------------------------- traced by torch.compile

    def _hooks_stand_aside(self) -> bool:
        """Under dynamo, between the wrapper's hooks (``traced.gather_in_graph``, ``release_in_graph``): the graph
        gathers and frees, so the hooks do nothing (and dynamo traces them, a check and a return, rather than
        breaking the graph at them)."""
        return torch.compiler.is_compiling() and self.gathered_in_graph

    # ----------------------------------------------------------------- forward

    @eager_as_a_frame_of_its_own
    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The unit's forward pre-hook: gathers (and casts the inputs), unless the hooks stand aside."""
        if self._hooks_stand_aside():
            return None
        return self._gather_for_forward(module, args, kwargs)

    @untraced
    @timed(HOOK)
    def _gather_for_forward(self, _module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.state is TrainingState.BACKWARD:
            self._to_backward()  # activation checkpointing re-runs a forward during backward: the same views
        else:
            self._to_forward()
        if self.mixed_precision.param_dtype is not None:
            return cast_floating_tensors((args, kwargs), self.mixed_precision.param_dtype)
        return None

    def _to_forward(self) -> None:
        """Gathered for forward, showing the full views (recording the order on the first step)."""
        if self.is_root:
            self._root_pre_forward()
        order = self.root.context.execution_order
        order.record(self)
        self._unshard()
        if self.overlap.forward_prefetch and (upcoming := order.after(self)) is not None:
            upcoming._start_unshard()
        for handle in self.handles:
            handle.use_full_views(new_forward=True)
        self.state = TrainingState.FORWARD

    @eager_as_a_frame_of_its_own
    def _pre_forward_of_part(self, part: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """A module inside this unit is called while the unit is not computing: gather as for the unit's forward."""
        if self._hooks_stand_aside() or self.state is not TrainingState.IDLE or self._called_alone is not None:
            return None  # the unit is computing (this part is one step of it), or another part gathered it
        self._called_alone = part
        return self._pre_forward(part, args, kwargs)

    @eager_as_a_frame_of_its_own
    def _post_forward_of_part(self, part: nn.Module, args: tuple, output) -> None:
        if self._called_alone is part:
            self._post_forward(part, args, output)
            self._called_alone = None

    @eager_as_a_frame_of_its_own
    def _post_forward(self, module: nn.Module, args: tuple, output) -> None:
        """The unit's forward hook: frees (or keeps for backward), unless the hooks stand aside."""
        if not self._hooks_stand_aside():
            self._free_after_forward(module, args, output)

    @untraced
    @timed(HOOK)
    def _free_after_forward(self, _module, _args, output) -> None:
        if self.is_root and self._called_alone is None:  # the order of a whole forward, not of a part's
            self.context.execution_order.stop_recording_unless_empty()
        backward_follows = torch.is_grad_enabled()
        if backward_follows:
            for handle in self.handles:
                handle.gradient.awaiting = handle.requires_grad
            _register_on_output_tensors(output, self._pre_backward)
        self._to_idle(reshard=not (backward_follows and self.keeps_gathered_for_backward))

    def _root_pre_forward(self) -> None:
        """Clears what an abandoned step (a forward with no backward) may have left."""
        self.context.finish_reduction_in_flight()
        for unit in self.context.units:
            if unit.state is not TrainingState.IDLE:
                unit._to_idle()
            for handle in unit.handles:
                handle.gradient.awaiting = False
                handle.gradient.release_cleared_by_user()

    # ----------------------------------------------------------------- backward

    @timed(HOOK)
    def _pre_backward(self, _grad: torch.Tensor) -> None:
        """Runs when the gradient of one of this unit's outputs is ready: gather for backward."""
        self._queue_end_of_backward()
        if self.state is not TrainingState.BACKWARD:
            self._to_backward()
            if self.overlap.backward_prefetch and (upcoming := self.root.context.execution_order.before(self)):
                upcoming._start_unshard()

    @timed(HOOK)
    def _post_backward(self, handle: FlatParamHandle) -> None:
        """Runs when autograd has summed every use's gradient into ``handle.full_flat.grad``."""
        handle.gradient.awaiting = False
        if self.requires_gradient_sync:
            asynchronous = self.overlap.async_reduce_scatter
            if asynchronous:
                self.root.context.finish_reduction_in_flight()  # at most one in flight bounds the memory held
            handle.gradient.reduce(asynchronous=asynchronous)
            if asynchronous:
                self.root.context.leave_in_flight(handle)
            else:
                self.root.context.gradient_reduced(handle)
        if not any(h.gradient.awaiting for h in self.handles):
            self._to_idle()

    def _queue_end_of_backward(self) -> None:
        self.root.context.queue_end_of_backward(self.root._end_of_backward)

    @timed(HOOK)
    def _end_of_backward(self) -> None:
        """Reduces gradients that never arrived (unused units or outputs), frees everything, and leaves
        ``.grad`` None on every parameter that no rank used.

        Runs in the same unit order on every rank, so ranks stay in step even when
        some unit's parameters took no part in this backward. A gradient kept
        unsharded by ``no_sync()`` is reduced at the first backward with sync.
        """
        self.context.finish_reduction_in_flight()
        for unit in self.context.units:
            for handle in unit.handles:
                if unit.requires_gradient_sync and (handle.gradient.awaiting or handle.full_flat.grad is not None):
                    handle.gradient.reduce()
                handle.gradient.awaiting = False
                handle.gradient.give_gradients_left_out_of_graph()
                handle.gradient.wait_for_arrival()  # offloaded from a GPU: the copies home have landed
            unit._to_idle()
        if self.requires_gradient_sync:
            self._drop_gradients_no_rank_used()
            self.context.backward_reduced()
        self.context.end_of_backward_done()

    def _drop_gradients_no_rank_used(self) -> None:
        """One small all-reduce per backward tells every rank which parameters got a gradient on any rank
        (a skipped branch, an expert no token chose, a head used on some ranks only); the others get
        ``.grad = None``, as in one process. A parameter used on some ranks keeps the average."""
        # A handle a compiled graph reduced got its gradients, or none, from the graph: the same on every rank.
        handles = [handle for unit in self.context.units for handle in unit.handles
                   if handle.requires_grad and not handle.gradient.reduced_in_graph]
        flags = torch.tensor([flag for handle in handles for flag in handle.gradient.received], dtype=torch.float32)
        if not flags.numel():
            return
        self.comm.all_reduce_sum_(flags, "<which parameters got gradients>")
        used_on_some_rank = (flags > 0).tolist()
        start = 0
        for handle in handles:
            handle.gradient.drop_unused(used_on_some_rank[start:start + len(handle.slots)])
            start += len(handle.slots)

    # ----------------------------------------------------------------- transitions: each sets the state

    def _to_backward(self) -> None:
        """Gathered for backward, showing the full views that autograd saved in forward."""
        self._unshard()
        for handle in self.handles:
            handle.use_full_views(new_forward=False)
        self.state = TrainingState.BACKWARD

    def _to_idle(self, reshard: bool = True) -> None:
        """Not computing; freed unless `reshard` is False (the root, or SHARD_GRAD_OP, keep theirs for backward)."""
        if reshard:
            self._reshard()
        self.state = TrainingState.IDLE

    # ----------------------------------------------------------------- gather / free

    def _unshard(self) -> None:
        for handle in self.handles:
            handle.unshard()

    def _start_unshard(self) -> None:
        for handle in self.handles:
            handle.start_unshard()

    def _reshard(self) -> None:
        for handle in self.handles:
            handle.reshard()


def _parts(module: nn.Module) -> list[nn.Module]:
    """The modules inside a unit's module that belong to it: not the module itself, nested units, nor the
    wrappers around them (calling those gathers the nested unit, not this one)."""
    return [part for _, part in modules_outside_units(module)
            if part is not module and WRAPPED_MODULE not in part._modules]


def modules_outside_units(module: nn.Module, prefix: str = "", seen: set | None = None):
    """Yields (name, submodule) for `module` and its descendants, not entering modules that are units already."""
    seen = set() if seen is None else seen
    if id(module) in seen:
        return
    seen.add(id(module))
    yield prefix, module
    for name, child in module.named_children():
        if UNIT_ATTRIBUTE not in child.__dict__:
            yield from modules_outside_units(child, f"{prefix}.{name}" if prefix else name, seen)


def _queue_end_of_backward(unit: ShardedUnit):
    """What a compiled graph calls after it reduced one of `unit`'s handles: the root's end of backward, queued
    (it reduces what no_sync kept for units the graph did not run, and hands out the gradients the graph could
    not). Holds the unit weakly, as ``_post_backward_hook``."""
    unit_ref = weakref.ref(unit)
    return lambda: unit_ref()._queue_end_of_backward()


def _post_backward_hook(unit: ShardedUnit, handle: FlatParamHandle):
    """The hook that reduces `handle`'s gradient once autograd has accumulated it into ``full_flat``.

    It holds the unit and the handle weakly: the hook lives in C++, out of the garbage collector's sight, so
    strong references (the handle holds ``full_flat``) would make a cycle that keeps the shards of a model its
    user dropped alive until the process ends.
    """
    unit_ref, handle_ref = weakref.ref(unit), weakref.ref(handle)
    return lambda _full_flat: unit_ref()._post_backward(handle_ref())


def _register_on_output_tensors(output, hook) -> None:
    """Registers `hook` on every tensor nested in `output` that needs a gradient."""
    for_each_tensor(lambda tensor: tensor.register_hook(hook) if tensor.requires_grad else None, output)

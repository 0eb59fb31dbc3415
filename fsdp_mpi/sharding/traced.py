"""A unit's gather and reduction as operators that ``torch.compile`` traces: the whole wrapped model in one graph.

Eager code gathers in the unit's hooks (``lifecycle.py``), which talk to MPI and
keep state, so compiled code cannot trace them: each unit would end a graph. Code
that dynamo traces takes this path instead (the wrapper's forward hooks,
``gather_in_graph`` and ``release_in_graph``), in which the lifecycle is data flow:

    forward:   pieces of the shard (the sharded views) -> fsdp_mpi::all_gather_unit (of the flat shard they
               are slices of) -> split into full views (_FullViews) -> shown as the module's parameters while
               it is called
    backward:  the full views' gradients, times 1/N -> cat -> fsdp_mpi::reduce_scatter_unit -> split -> each
               sharded view's .grad, none where its full view got none

The two collectives are custom operators (``torch.library``) with fake
implementations, so dynamo and AOTAutograd see their shapes without running
them; ``_FullViews``' backward is the reduction, and autograd accumulates each
piece of the reduced shard into its sharded view's ``.grad`` as for any
parameter. The graph hands a parameter it does not use no gradient, as eager
backward does; under ``no_sync`` what the graph cannot hand over, and what units
it did not run kept, the root's end of backward does (``lifecycle.py``). The gather
and the views sit in a selective-checkpoint region whose every op must be
recomputed: the compiled forward frees the gathered weights when their last
user is done, and the compiled backward gathers them again just before it needs
them, as the eager hooks do (a unit that keeps its weights for backward, the
root and ``SHARD_GRAD_OP``'s, takes no region). On one rank with no replicas each
sharded view is its whole parameter, and the views are plain views of it: the
graph is plain torch's. A hook that dynamo meets as a frame of its own runs
eagerly (``eager_as_a_frame_of_its_own``): compiled whole, the root gathers around
the graph, and its parameters are the graph's inputs.
Prefetch and asynchronous reduction are the eager hooks' business; compiled,
each collective runs where the graph puts it, and every rank must compile the
same graph (the same model, called the same way), which the collectives' order
then follows on every rank.

The operators reach the handle through a name (``traced_id``), the only way a
graph can name it; the handle does the communication as the eager path does
(``FlatParamHandle.gather`` and ``FlatGradient.reduce_in_graph``), so the same collectives,
dtypes and compression apply, and a compiled step equals an eager one.
"""

import functools
import itertools
import sys
import weakref
from collections.abc import Callable

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from fsdp_mpi.sharding.flat_param import FlatParamHandle
from fsdp_mpi.sharding.mixed_precision import cast_floating_tensors

_handles: "weakref.WeakValueDictionary[str, FlatParamHandle]" = weakref.WeakValueDictionary()
_after_reduction: dict[str, Callable[[], None]] = {}
_numbers = itertools.count()


def register(handle: FlatParamHandle, after_reduction: Callable[[], None]) -> str:
    """A name by which the traced operators find `handle` (held weakly). A string, not a number: dynamo may
    make a number that differs between calls of the same code symbolic, never a string. `after_reduction`
    runs after each synced reduction in a graph (the unit queues its end of backward: it must not hold the
    handle strongly)."""
    name = str(next(_numbers))
    _handles[name] = handle
    _after_reduction[name] = after_reduction
    weakref.finalize(handle, _after_reduction.pop, name, None)
    return name


def untraced(method):
    """``torch.compiler.disable`` for an eager hook that talks to MPI: compiled code calls it, never traces it.

    Disabling a function imports dynamo (0.9 s of CPU) at once, in every rank of every program that imports
    fsdp_mpi: so the disabled form is made at the first call with dynamo loaded (without it nothing compiles,
    and the method runs as it is). The mark that dynamo reads when it traces a call is on from the start, so a
    traced call ends the graph there, as at any disabled function.
    """
    disabled = None

    @functools.wraps(method)
    def call(*args, **kwargs):
        nonlocal disabled
        if "torch._dynamo" not in sys.modules:
            return method(*args, **kwargs)
        if disabled is None:
            disabled = torch.compiler.disable(method)
        return disabled(*args, **kwargs)

    call._torchdynamo_disable = True
    return call


_EAGER_AS_FRAMES: list = []  # the code of the functions below, and of every untraced function's `call`
_eager_frames_marked = False


def eager_as_a_frame_of_its_own(function):
    """Marks a hook that dynamo may meet as a frame of its own, outside any graph: ``torch.compile(model)`` runs
    the compiled module's hooks outside the frame it compiles, as does the eager code around a graph that
    dynamo gave up on (a break in a loop). There it runs as it is, eagerly (the root then gathers as in an
    eager step, and the frame dynamo compiles is the model's own forward, as unwrapped); inlined into a graph
    it is traced as any code. Its code is told to dynamo once it is loaded (``mark_eager_frames_for_dynamo``)."""
    _EAGER_AS_FRAMES.append(function.__code__)
    return function


_EAGER_AS_FRAMES.append(untraced(lambda: None).__code__)  # met alone (after a break at its call): 2 breaks more


def mark_eager_frames_for_dynamo() -> None:
    """Once dynamo is loaded, has it run the marked frames as they are, and what they call (its frame execution
    strategy, which ``torch._dynamo.skip`` sets for the frame alone; it does not touch where a graph inlines
    the function). Called where a compile first meets the wrapped model, before any of its hooks can run:
    where ``torch.compile(model)`` reads the root's ``forward``, and at the first traced gather."""
    global _eager_frames_marked
    if _eager_frames_marked or "torch._dynamo" not in sys.modules:
        return
    _eager_frames_marked = True
    # Not public: where it has moved, these frames are compiled (a graph more, or two breaks, each). Nothing may
    # escape as AttributeError: the wrapper's ``forward`` property calls this, and Python would take such an
    # error for a missing ``forward`` and call the wrapped module's own, bypassing its hooks.
    try:
        from torch._dynamo.eval_frame import set_code_exec_strategy
        from torch._dynamo.types import FrameAction, FrameExecStrategy

        run_as_they_are = FrameExecStrategy(FrameAction.SKIP, FrameAction.SKIP)
    except (ImportError, AttributeError):
        return
    for code in _EAGER_AS_FRAMES:
        set_code_exec_strategy(code, run_as_they_are)


@torch.library.custom_op("fsdp_mpi::all_gather_unit", mutates_args=())
def all_gather_unit(pieces: list[torch.Tensor], handle: str) -> torch.Tensor:
    """This rank's pieces of the shard (its sharded views, flat) -> (padded_numel,) of every rank's shard, in
    ``param_dtype``. The pieces are slices of the flat shard, which the gather reads as it is, as eager's does:
    they are the inputs only so that the graph orders the gather after what wrote them (their concatenation
    would copy the shard once more)."""
    found = _handles[handle]
    full = torch.empty(found.padded_numel, dtype=found.param_dtype, device=found.compute_device)
    found.gather.into(full, found.shard, found.unit_name)
    return full


@all_gather_unit.register_fake
def _(pieces: list[torch.Tensor], handle: str) -> torch.Tensor:
    _let_dynamo_put_views_in_graph()
    found = _handles[handle]
    return pieces[0].new_empty(found.padded_numel, dtype=found.param_dtype, device=found.compute_device)


@torch.library.custom_op("fsdp_mpi::reduce_scatter_unit", mutates_args=("full_grad",))
def reduce_scatter_unit(full_grad: torch.Tensor, handle: str, sync: bool, used: list[bool]) -> torch.Tensor:
    """(padded_numel,) gradient of this rank, already times 1/N -> (shard_numel,) averaged over the ranks, in
    the shard's dtype; `used`: which parameters (slots) got a gradient in this graph (False inside
    ``no_sync``). It reduces in `full_grad` itself (the transports use their input as scratch), and says so:
    the graph then hands it the buffer that backward assembled the gradient in (inductor), where an operator
    that may not write its input would copy it first."""
    shard_grad = _handles[handle].gradient.reduce_in_graph(full_grad, sync, used)
    if sync:
        _after_reduction[handle]()
    return shard_grad


@reduce_scatter_unit.register_fake
def _(full_grad: torch.Tensor, handle: str, sync: bool, used: list[bool]) -> torch.Tensor:
    found = _handles[handle]
    return full_grad.new_empty(found.shard_numel, dtype=found.shard.dtype)


class _FullViews(torch.autograd.Function):
    """The gathered (padded_numel,) buffer -> one full-shape view per slot; backward: the views' gradients ->
    the reduced gradient of each sharded view (the pieces of the shard), None for a parameter that got none.
    Each gradient is multiplied by 1/N (``FlatGradient.scale``) as it is copied into the flat gradient: in one
    pass, which inductor fuses (where a separate pass would read and write the whole gradient once more).

    Dynamo would trace this function's backward with a gradient for every view, zeros where none came: so it
    puts the call in its graph as it is (``allow_in_graph``), and AOT autograd, which traces it with autograd
    itself, shows backward which views got no gradient. Which ones is a fact of the graph, the same in every
    step that runs it; the reduction keeps it (``FlatGradient.reduce_in_graph``) for ``no_sync``.
    """

    @staticmethod
    def forward(handle: str, sync: bool, full: torch.Tensor, *pieces: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return _handles[handle].split_full(full)

    @staticmethod
    def setup_context(ctx, inputs, output) -> None:
        ctx.handle, ctx.sync = inputs[0], inputs[1]
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        found = _handles[ctx.handle]
        used = [grad is not None for grad in grads]
        like, scale = next(grad for grad in grads if grad is not None), found.gradient.scale
        full_grad = torch.cat([*((grad.reshape(-1) if scale == 1.0 else grad.reshape(-1) * scale)
                                 if grad is not None else like.new_zeros(slot.numel)
                                 for grad, slot in zip(grads, found.slots)),
                               like.new_zeros(found.padded_numel - found.numel)])
        shard_grad = reduce_scatter_unit(full_grad, ctx.handle, ctx.sync, used)
        pieces = shard_grad.split(found.shard_pieces)
        return None, None, None, *(piece if got else None for piece, got in zip(pieces, used))


def _full_views(handle: str, sync: bool, full: torch.Tensor, *pieces: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return _FullViews.apply(handle, sync, full, *pieces)


@functools.cache
def _let_dynamo_put_views_in_graph() -> None:
    """Marks ``_full_views`` (and the hooks' frames) for dynamo, at the first trace of a gather (whose shape
    dynamo asks for before it reaches the views): marking it when fsdp_mpi is imported would import dynamo in
    every program."""
    torch._dynamo.allow_in_graph(_full_views)
    mark_eager_frames_for_dynamo()


def _recompute_everything(_ctx, _op, *_args, **_kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_RECOMPUTE


_RECOMPUTED = functools.partial(create_selective_checkpoint_contexts, _recompute_everything)


def gather_in_graph(unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """A wrapper's forward pre-hook. In code that dynamo traces, `unit` (a ``lifecycle.ShardedUnit``) gathers in
    the graph: each handle's full views shadow its parameter attributes, as eager forward's
    do, and the inputs are cast under mixed precision; until ``release_in_graph`` the unit's hooks and its
    parts' stand aside. Hooks around the module's own call, not a call of ours: dynamo resumes a broken graph
    only in the frame it compiled, so a frame of ours between the model's would cost a break more wherever the
    model's code breaks one inside the unit."""
    if not torch.compiler.is_compiling():
        return None
    for handle in unit.handles:
        handle.install_full_views(traced_full_views(handle, unit.requires_gradient_sync,
                                                    unit.keeps_gathered_for_backward))
    unit.gathered_in_graph = True
    if unit.mixed_precision.param_dtype is not None:
        return cast_floating_tensors((args, kwargs), unit.mixed_precision.param_dtype)
    return None


def release_in_graph(unit) -> None:
    """A wrapper's forward hook: after ``gather_in_graph``, the unit's parameters are its sharded views again
    (the graph frees the full ones after their last use)."""
    if unit.gathered_in_graph and torch.compiler.is_compiling():
        unit.gathered_in_graph = False
        for handle in unit.handles:
            handle.use_sharded_views()


def traced_full_views(handle: FlatParamHandle, sync: bool, keep: bool) -> tuple[torch.Tensor, ...]:
    """The handle's full-shape views, one per slot, computed by operators that dynamo traces. `keep`: saved
    for backward (the root, SHARD_GRAD_OP); otherwise gathered again in backward."""

    if handle.communicates_nothing:  # one rank, no replicas: each sharded view is its whole parameter, and
        handle.gradient.reduced_in_graph = True  # the graph's gradient its own (the end of backward leaves it)
        return tuple(view.to(handle.compute_device, handle.param_dtype).view(slot.shape)
                     for view, slot in zip(handle.sharded_views, handle.slots))

    def gathered(*pieces: torch.Tensor) -> tuple[torch.Tensor, ...]:
        flat = [piece.detach().view(-1) for piece in pieces]  # dynamo runs the gather's fake here, which marks
        full = all_gather_unit(flat, handle.traced_id)  # _full_views
        return _full_views(handle.traced_id, sync, full, *pieces)

    if keep or not torch.is_grad_enabled():
        return gathered(*handle.sharded_views)
    return checkpoint(gathered, *handle.sharded_views, use_reentrant=False, context_fn=_RECOMPUTED)

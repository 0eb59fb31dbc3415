"""A unit's parameters flattened into one padded buffer, of which each rank keeps 1/N.

One handle holding parameters ``a`` (6 elements) and ``b`` (3 elements) on 4 ranks::

    full_flat (padded_numel = 12):  a a a a a a b b b 0 0 0
    shards:                         [rank 0][rank 1][rank 2][rank 3]   (shard_numel = 3)
    sharded views on rank 1:        a = shard[0:3]  b = shard[0:0]     (rank 2: a = [0:0], b = [0:3])

``shard`` (``shard_numel`` elements) is all a rank keeps between uses. The
optimizer never sees it directly: each original parameter is replaced, under its
own name, by a *sharded view*, an ``nn.Parameter`` that is the 1-D slice of
``shard`` holding this rank's part of that parameter (possibly empty). So
``model.named_parameters()`` keeps the user's names, optimizer parameter groups
work as on one process, optimizer state is sharded, and an in-place update of a
view updates the shard that the next all-gather sends.

``full_flat`` is the gathered buffer, in the dtype the module computes with
(``param_dtype`` under mixed precision: the shard is cast once, then gathered, so
16-bit compute halves the bytes of every all-gather). Its storage exists only between ``unshard()``
and ``reshard()``; in between the storage is emptied, not merely dereferenced, its memory
given back (to the pool of ``host_memory.py`` on a CPU, to the allocator elsewhere). While a unit
computes, each parameter attribute (``linear.weight``) is shadowed by a full-shape
view into ``full_flat`` (an entry in the module's ``__dict__``, which Python looks
up before ``nn.Module``'s registered parameters); ``use_sharded_views()`` removes
the shadows, so outside computation the attribute is the sharded view again.
The full views are made once and bound, in each forward, to a new ``FullViews`` autograd node, whose backward
writes their gradients into one flat gradient already multiplied by 1/N (N: the
ranks the gradient is averaged over), so the mean costs no pass of its own: MPI
sums, and nothing divides afterwards. Autograd sums the gradient of every use
(tied weights, a unit run twice) into one ``full_flat.grad``, which
``reduce_gradient()`` reduce-scatters (in ``reduce_dtype``) into ``shard_grad``, of
the shard's dtype; each sharded view's ``.grad`` is the matching slice of it.
A 16-bit gradient (mixed precision) is not scaled, since 1/3 would round in 16
bits: its fp32 sum is divided instead. Under ``Compression`` (``compression.py``)
the gather moves the encoded fp32 shard and decodes it into ``full_flat``, and the
reduction is an all-to-all of encoded gradient chunks summed here in fp32; the
shard and ``shard_grad`` keep their layout and dtype. Which of these collectives
a handle uses is chosen once, when it is built (``collectives.py``). State dicts and
``summon_full_params`` gather the shards themselves into a separate buffer
(``gather_masters()``), never ``full_flat``.

Every rank must flatten the same parameters in the same order, or the all-gather
would silently mix up parameters; the unit checks this across ranks at wrap time.
"""

from dataclasses import dataclass

import torch
from torch import nn

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.compression import Compression
from fsdp_mpi.sharding.collectives import choose_gather, choose_reduction
from fsdp_mpi.sharding.full_views import FullViews, split_into_views
from fsdp_mpi.sharding.host_memory import BorrowedBuffer, buffers_for

# Set on each original parameter once it is flattened, so that a second unit
# claiming the same (shared) parameter is caught instead of silently untying it.
OWNER_ATTRIBUTE = "_fsdp_mpi_owner"


@dataclass(frozen=True)
class ParamUse:
    """One place where a module uses a parameter: ``getattr(owner, attribute)``."""

    name: str  # relative to the unit's wrapped module, e.g. "fc1.weight"
    owner: nn.Module
    attribute: str


@dataclass(frozen=True)
class ParamSlot:
    """Where one original parameter lives inside the flat buffer, and which part of it this rank holds."""

    uses: tuple[ParamUse, ...]  # more than one for tied parameters
    shape: torch.Size
    offset: int  # into full_flat
    numel: int
    shard_start: int  # this rank's part: shard[shard_start:shard_stop] (empty if it holds none)
    shard_stop: int


class FlatParamHandle:
    """Owns the flat shard of some parameters of one unit, all of one dtype and ``requires_grad``.

    Args:
        params: each original parameter with every place it is used, in an order
            that is identical on every rank.
        comm: the communicator whose ranks share the shards (the shard group).
        unit_name: for error messages (which unit owns a parameter) and the collective log; the
            root renames it to the unit's module path once the whole model is wrapped.
        param_dtype: the dtype gathered and computed with (None: the parameters' own).
        reduce_dtype: the dtype gradients are averaged in (None: the parameters' own).
        device: where the shard lives. Parameters on the ``meta`` device (deferred
            initialisation) need it; their shard starts as zeros, to be filled by
            ``copy_into_shard()``.
        replicas: the ranks holding this same shard in other shard groups (HYBRID_SHARD,
            NO_SHARD), over which each reduced gradient is then averaged; None: none.
        compression: how gathered weights and reduced gradients travel (``compression.py``; floating-point
            parameters only); None: in ``param_dtype`` and ``reduce_dtype``.
    """

    def __init__(self, params: list[tuple[nn.Parameter, list[ParamUse]]], comm: Communicator, unit_name: str,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 device: torch.device | None = None, replicas: Communicator | None = None,
                 compression: Compression | None = None):
        first = params[0][0]
        device = first.device if device is None or not first.is_meta else device
        self.comm = comm
        self.replicas = replicas
        self.unit_name = unit_name
        self.requires_grad = first.requires_grad
        low_precision_applies = first.is_floating_point()
        self.param_dtype = param_dtype if param_dtype and low_precision_applies else first.dtype
        self.reduce_dtype = reduce_dtype if reduce_dtype and low_precision_applies else first.dtype
        compression = compression if compression is not None and low_precision_applies else Compression()
        self.gather = choose_gather(comm, compression.weight_codec)  # how full_flat is filled from the shards
        self.reduction = choose_reduction(comm, replicas, compression.gradient_codec)  # how gradients are summed
        self.numel = sum(param.numel() for param, _ in params)
        self.padded_numel = -(-self.numel // comm.world_size) * comm.world_size
        self.shard_numel = self.padded_numel // comm.world_size
        self.shard_offset = comm.rank * self.shard_numel
        # Gradients are averaged over the shard group and the replicas: backward scales them by
        # 1/gradient_divisor as it assembles them, unless they are 16-bit or cast before reducing
        # (then the sum, in reduce_dtype or fp32, is divided).
        self.gradient_divisor = comm.world_size * (replicas.world_size if replicas is not None else 1)
        self.scale_in_backward = self.param_dtype == self.reduce_dtype and self.param_dtype.itemsize > 2
        self.gradient_scale = 1 / self.gradient_divisor if self.scale_in_backward else 1.0
        self.slots: list[ParamSlot] = []
        offset = 0
        for param, uses in params:
            start = min(max(offset - self.shard_offset, 0), self.shard_numel)
            stop = min(max(offset + param.numel() - self.shard_offset, 0), self.shard_numel)
            self.slots.append(ParamSlot(tuple(uses), param.shape, offset, param.numel(), start, stop))
            offset += param.numel()
        self._shapes = tuple(slot.shape for slot in self.slots)
        # Each place a parameter attribute is shown, as (its module's __dict__, the attribute, the slot's index):
        # showing full or sharded views runs every forward and backward, so it is one flat loop.
        self._attribute_places = [(use.owner.__dict__, use.attribute, index)
                                  for index, slot in enumerate(self.slots) for use in slot.uses]
        # The slots' parts of the shard lie end to end: one split gives every sharded view's piece, the padding last.
        held = [slot.shard_stop - slot.shard_start for slot in self.slots]
        self.shard_pieces = [*held, self.shard_numel - sum(held)]

        self.shard = torch.zeros(self.shard_numel, dtype=first.dtype, device=device)  # padding stays zero
        if not first.is_meta:
            for slot, (param, _) in zip(self.slots, params):
                self.copy_into_shard(slot, param.detach())
        self.shard_grad: torch.Tensor | None = None  # (shard_numel,): the reduced gradient
        self.reuse_buffers(comes_back=True)  # the unit says otherwise once it knows (lifecycle.py)
        # On one rank, unless cast, the shard is the whole buffer: full_flat aliases it, nothing is copied.
        self.aliases_shard = comm.world_size == 1 and self.param_dtype == self.shard.dtype
        if self.aliases_shard:
            # .data, not .detach(): its own version counter, so the optimizer's in-place step on the shard
            # leaves the kept full views (use_full_views) valid, as a separate buffer on N ranks would.
            self.full_flat = self.shard.data.requires_grad_(self.requires_grad)
        else:
            self.full_flat = torch.empty(self.padded_numel, dtype=self.param_dtype, device=device)
            self.full_flat.requires_grad_(self.requires_grad)
            self.full_flat.untyped_storage().resize_(0)  # (padded_numel,) of param_dtype while gathered
        # True from a forward that autograd records until this handle's gradient is reduced.
        self.awaiting_gradient = False
        self._full_views: tuple[torch.Tensor, ...] | None = None  # full-shape views into full_flat, one per slot
        # Per slot: whether backward gave it a gradient on this rank since the last reduction (FullViews sets
        # them), and whether its sharded view holds a gradient (one process's ``.grad is not None``).
        self.got_gradient = [False] * len(self.slots)
        self._holds_gradient = [False] * len(self.slots)
        # Whether the last reduction was a compiled graph's, which gave each sharded view its gradient (or none),
        # and the parts of it that the graph could not give (traced_reduction): (slot index, piece of shard_grad).
        self.reduced_in_graph = False
        self._left_out_of_graph: list[tuple[int, torch.Tensor]] = []
        self._pending_gather = None  # a prefetch in flight: wait() completes it
        self._pending_reduction = None  # an asynchronous reduce-scatter: wait() returns its shard_grad

        # The sharded views replace the original parameters under their names (tied ones stay one object).
        self.sharded_views: list[nn.Parameter] = []
        for slot, (param, _) in zip(self.slots, params):
            view = nn.Parameter(self.shard[slot.shard_start:slot.shard_stop], requires_grad=self.requires_grad)
            self.sharded_views.append(view)
            setattr(param, OWNER_ATTRIBUTE, unit_name)
            setattr(view, OWNER_ATTRIBUTE, unit_name)
            for use in slot.uses:
                use.owner._parameters[use.attribute] = view

    # ------------------------------------------------------------ gather and free

    @property
    def is_unsharded(self) -> bool:
        """Whether the full parameters are available in ``full_flat``."""
        return self.full_flat.untyped_storage().size() > 0

    @property
    def gathered_bytes(self) -> int:
        """Memory held for gathered parameters beyond the shard."""
        return 0 if self.aliases_shard else self.full_flat.untyped_storage().nbytes()

    def unshard(self) -> None:
        """All-gathers the full parameters into ``full_flat`` (a no-op if they are there)."""
        if self._pending_gather is not None:
            self._pending_gather.wait()
            self._pending_gather = None
        elif not self.is_unsharded:
            self._allocate_full_storage()
            self.gather.gather(self.full_flat.data, self.shard, self.unit_name)

    def start_unshard(self) -> None:
        """Starts gathering without waiting (a prefetch); ``unshard()`` completes it."""
        if self._pending_gather is None and not self.is_unsharded:
            self._allocate_full_storage()
            self._pending_gather = self.gather.start_gather(self.full_flat.data, self.shard, self.unit_name)

    def gather_masters(self) -> torch.Tensor:
        """A new (padded_numel,) buffer of every rank's shard in the shard's own dtype, the master copy (fp32
        under mixed precision or compression), uncompressed: for state dicts and ``summon_full_params``."""
        full = torch.empty(self.padded_numel, dtype=self.shard.dtype, device=self.shard.device)
        self.comm.all_gather_into(full, self.shard, self.unit_name)
        return full

    def reshard(self) -> None:
        """Releases the gathered storage and shows the sharded views again; only the shard remains."""
        if self._pending_gather is not None:  # MPI may still be writing into it
            self.unshard()
        self.use_sharded_views()
        if self.is_unsharded and not self.aliases_shard:
            self._free_full_storage()

    def reuse_buffers(self, comes_back: bool) -> None:
        """Takes gathered and full-gradient memory from the pool if the unit's buffers `comes_back` within a step
        (it gathers again in backward), else anew (``host_memory.buffers_for``). Before the first gather."""
        self.buffers = buffers_for(self.shard.device, comes_back)
        # Holds the full gradient that backward assembles until its reduction is done, where the reduction makes
        # a new shard of it (a shard group of one rank keeps the full gradient as its shard).
        self._full_gradient_buffer = (BorrowedBuffer(self.buffers, self.shard.device) if self.comm.world_size > 1
                                      else None)

    def _allocate_full_storage(self) -> None:
        self.buffers.fill(self.full_flat.untyped_storage(), self.padded_numel * self.full_flat.element_size())

    def _free_full_storage(self) -> None:
        self.buffers.drain(self.full_flat.untyped_storage())

    # ------------------------------------------------------------ which tensor a parameter attribute is

    def use_full_views(self, new_forward: bool) -> None:
        """Shadows every parameter attribute with a full-shape view into ``full_flat``.

        The views are made once, the first time they are needed, and kept: every
        forward, backward and recomputation under activation checkpointing shows
        the same tensors. Their storage is ``full_flat``'s, which reshard releases
        and unshard refills, so they show whatever was gathered last. A
        `new_forward` that autograd records first binds them to a new
        ``FullViews`` node, through which autograd reaches ``full_flat`` and
        whose backward assembles the flat gradient in one pass. Backward, and a
        recomputation inside it, show them as the forward left them: bound to
        the node that forward's saved tensors lead to. Making the views anew
        each forward would cost a view per parameter, host time that a GPU step
        of small units waits for; reusing one node across steps would delay
        every backward's reduction to its end (``FullViews``).
        """
        if self._full_views is None:
            with torch.no_grad():
                self._full_views = split_into_views(self.full_flat.detach(), self._shapes)
        if new_forward and self.requires_grad and torch.is_grad_enabled():
            FullViews.apply(self.full_flat, self._full_views, self.gradient_scale, self.got_gradient,
                            self._full_gradient_buffer)
        self.install_full_views(self._full_views)

    @property
    def communicates_nothing(self) -> bool:
        """One rank and no replicas: the shard is the whole buffer, and its gradient is the average already."""
        return self.comm.world_size == 1 and self.replicas is None

    @property
    def shard_padding(self) -> int:
        """Elements of the shard after the last parameter's part: zeros, on the last ranks only."""
        return self.shard_pieces[-1]

    def split_full(self, full: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One full-shape view per parameter into a (padded_numel,) buffer, in slot order (no autograd)."""
        return split_into_views(full, self._shapes)

    def install_full_views(self, views: list[torch.Tensor]) -> None:
        """Shadows each parameter attribute with the given full-shape view (one per slot), in the owner's
        ``__dict__``; ``use_sharded_views()`` removes them."""
        for namespace, attribute, index in self._attribute_places:
            namespace[attribute] = views[index]

    def use_sharded_views(self) -> None:
        """Removes the full views: each attribute is its registered sharded view again."""
        for namespace, attribute, _ in self._attribute_places:
            namespace.pop(attribute, None)

    # ------------------------------------------------------------ gradients

    def _give_back_full_gradient(self) -> None:
        """The reduction is done with the full gradient: its memory goes back to ``buffers``."""
        if self._full_gradient_buffer is not None:
            self._full_gradient_buffer.give_back()

    def reduce_gradient(self, asynchronous: bool = False) -> None:
        """Averages ``full_flat.grad`` over ranks into this rank's ``shard_grad`` and frees it.

        Reduce-scattered (summed) within the shard group, then all-reduced over the
        replicas if there are any; the gradient came out of backward already divided
        by the number of ranks, unless it is 16-bit (then the sum is divided here).
        A handle that got no gradient this backward contributes zeros, so every
        rank takes part in the same collectives. `asynchronous` only
        starts the reduce-scatter; ``finish_gradient_reduction()`` completes it and averages
        over the replicas (a compressed reduce-scatter, or a shard group of one rank, has
        nothing left to wait for by then).
        """
        full_grad = self.full_flat.grad  # (padded_numel,) of param_dtype
        if full_grad is None:
            full_grad = torch.zeros(self.padded_numel, dtype=self.reduce_dtype, device=self.shard.device)
        self.full_flat.grad = None
        self.awaiting_gradient = False
        self.reduced_in_graph = False
        full_grad = full_grad.to(self.reduce_dtype)
        if asynchronous:
            self._pending_reduction = self.reduction.start_reduce_scatter(full_grad, self.unit_name)
        else:
            self._average_over_replicas_and_accumulate(self.reduction.reduce_scatter(full_grad, self.unit_name))
            self._give_back_full_gradient()

    def finish_gradient_reduction(self) -> None:
        """Waits for an asynchronous reduce-scatter and adds its result to ``shard_grad``."""
        if self._pending_reduction is not None:
            shard_grad = self._pending_reduction.wait()
            self._pending_reduction = None
            self._give_back_full_gradient()
            self._average_over_replicas_and_accumulate(shard_grad)

    def traced_reduction(self, full_grad: torch.Tensor, sync: bool, used: list[bool]) -> torch.Tensor:
        """The compiled path's ``reduce_gradient`` (``traced.py``): a new (shard_numel,) gradient of the shard's
        dtype, averaged over the ranks, from backward's unscaled (padded_numel,) gradient of ``param_dtype``,
        which it scales (as ``FullViews`` does) and reduces in place. Without `sync` (``no_sync``) the gradient is
        kept, as the eager path keeps it, in ``full_flat.grad`` (a copy: the graph may reuse its buffer), and
        zeros come back; a later synced backward adds what was kept before reducing.

        `used` (one flag per slot) says which parameters got a gradient in the graph that calls it, which
        hands the others none (their ``.grad`` stays as it was: None after ``zero_grad``), as eager backward
        does. A parameter that got one in an earlier ``no_sync`` backward but none in this graph still has
        its part of the reduced gradient: it is handed over at the end of backward
        (``give_gradients_left_out_of_graph``), since the graph cannot."""
        used_since_reduction = [before or now for before, now in zip(self.got_gradient, used)]
        self.shard_grad = None  # the graph adds to the views' gradients: no longer pieces of ours (_accumulate)
        if self.scale_in_backward:
            full_grad.mul_(self.gradient_scale)
        kept = self.full_flat.grad
        self.full_flat.grad = None
        if not sync:
            self.got_gradient[:] = used_since_reduction
            self.full_flat.grad = full_grad.clone() if kept is None else kept.add_(full_grad)
            return torch.zeros(self.shard_numel, dtype=self.shard.dtype, device=self.shard.device)
        if kept is not None:
            full_grad.add_(kept)
        shard_grad = self._averaged(self.reduction.reduce_scatter(full_grad.to(self.reduce_dtype), self.unit_name))
        shard_grad = shard_grad.to(self.shard.dtype)
        self._left_out_of_graph = [(index, piece.clone()) for index, (piece, before, now)
                                   in enumerate(zip(shard_grad.split(self.shard_pieces), used_since_reduction, used))
                                   if before and not now]
        self.got_gradient[:] = [False] * len(self.slots)
        self.reduced_in_graph = True
        return shard_grad

    def give_gradients_left_out_of_graph(self) -> None:
        """Adds to the sharded views the gradients that a compiled graph reduced but could not hand them
        (``traced_reduction``)."""
        for index, piece in self._left_out_of_graph:
            view = self.sharded_views[index]
            view.grad = piece if view.grad is None else view.grad.add_(piece)
        self._left_out_of_graph = []

    @property
    def unsharded_gradient_bytes(self) -> int:
        """Memory held by a full-size gradient kept for a later reduction (``no_sync``)."""
        grad = self.full_flat.grad
        return 0 if grad is None or self.aliases_shard else grad.numel() * grad.element_size()

    def _average_over_replicas_and_accumulate(self, shard_grad: torch.Tensor) -> None:
        self._accumulate(self._averaged(shard_grad))

    def _averaged(self, shard_grad: torch.Tensor) -> torch.Tensor:
        """A reduce-scattered gradient summed over the replicas too and, unless backward scaled it, divided."""
        self.reduction.all_reduce_over_replicas(shard_grad, self.unit_name)
        if not self.scale_in_backward and self.gradient_divisor > 1:
            shard_grad.div_(self.gradient_divisor)
        return shard_grad

    def _accumulate(self, shard_grad: torch.Tensor) -> None:
        """Adds a reduced gradient to what the sharded views still hold, then exposes it through them."""
        self.release_gradient_cleared_by_user()
        if self.shard_grad is None:
            self.shard_grad = shard_grad.to(self.shard.dtype)
            for view, piece in zip(self.sharded_views, self.shard_grad.split(self.shard_pieces)):
                if view.grad is not None:  # given by a compiled graph (traced_reduction), not a piece of ours
                    piece += view.grad
        else:
            self.shard_grad += shard_grad
        for view, piece in zip(self.sharded_views, self.shard_grad.split(self.shard_pieces)):
            view.grad = piece

    def drop_gradients_of_unused(self, used_on_some_rank: list[bool]) -> None:
        """After a reduction: a parameter that no rank used since the last ``zero_grad`` has ``.grad`` None, as in
        one process, so that optimizers leave it alone (no weight decay, no momentum step)."""
        for index, (used, view) in enumerate(zip(used_on_some_rank, self.sharded_views)):
            self._holds_gradient[index] = self._holds_gradient[index] or used
            if not self._holds_gradient[index]:
                view.grad = None
        self.got_gradient[:] = [False] * len(self.slots)

    def release_gradient_cleared_by_user(self) -> None:
        """``optimizer.zero_grad()`` sets the views' ``.grad`` to None: their part of ``shard_grad`` is gone too."""
        for index, view in enumerate(self.sharded_views):
            if view.grad is None:
                self._holds_gradient[index] = False
        if self.shard_grad is None:
            return
        cleared = [slot for slot, view in zip(self.slots, self.sharded_views)
                   if view.grad is None and slot.shard_stop > slot.shard_start]
        holding = [slot for slot in self.slots if slot.shard_stop > slot.shard_start]
        if len(cleared) == len(holding):
            self.shard_grad = None
            return
        for slot in cleared:
            self.shard_grad[slot.shard_start:slot.shard_stop].zero_()

    # ------------------------------------------------------------ writing values into the shard

    def copy_into_shard(self, slot: ParamSlot, full_value: torch.Tensor) -> None:
        """Copies the part of one parameter's full value (any shape of ``slot.numel`` elements) that this rank keeps."""
        if slot.shard_stop > slot.shard_start:
            start = self.shard_offset + slot.shard_start - slot.offset  # into the flattened parameter
            with torch.no_grad():
                self.shard[slot.shard_start:slot.shard_stop].copy_(
                    full_value.reshape(-1)[start:start + slot.shard_stop - slot.shard_start])

    def part_held(self, slot: ParamSlot) -> tuple[int, int]:
        """[start, stop) of the flattened parameter that this rank's shard holds (start == stop if none)."""
        start = min(max(self.shard_offset + slot.shard_start - slot.offset, 0), slot.numel)
        return start, start + slot.shard_stop - slot.shard_start

    def write_back_shard(self, full: torch.Tensor) -> None:
        """Copies this rank's part of `full` (from ``gather_masters()``, possibly edited) into its shard."""
        with torch.no_grad():
            self.shard.copy_(full[self.shard_offset:self.shard_offset + self.shard_numel])

"""A handle's gradient: from the flat gradient that backward assembles to each sharded view's ``.grad``.

Eager backward sums every use's gradient into ``full_flat.grad`` (``full_views.py``
assembles it, already multiplied by 1/N); ``reduce()`` reduce-scatters it (in
``reduce_dtype``) into ``shard_grad``, of the shard's dtype, and each sharded
view's ``.grad`` is the matching slice of it. A compiled graph hands the views
their gradients itself (``reduce_in_graph()``, called by ``traced.py``). Either way
a parameter that no rank used keeps ``.grad`` None, as in one process
(docs/design.md, "No gradient means no gradient"): the per-slot flags live here.
"""

import torch

from fsdp_mpi.sharding.host_memory import BorrowedBuffer
from fsdp_mpi.sharding.offload import nothing_to_wait_for


class FlatGradient:
    """The gradient side of one ``FlatParamHandle``: its reduction, what the sharded views hold, and which
    parameters got a gradient.

    Args:
        handle: the handle (its layout, shard, sharded views and ``full_flat``, whose ``.grad`` autograd fills).
        reduction: how gradients are summed (``collectives.choose_reduction``).
        divisor: the ranks gradients are averaged over (the shard group times the replicas).
        reduce_dtype: the dtype gradients are reduced in.
    """

    def __init__(self, handle, reduction, divisor: int, reduce_dtype: torch.dtype):
        self.handle = handle
        self.reduction = reduction
        self.reduce_dtype = reduce_dtype
        self.divisor = divisor
        # Backward scales by 1/divisor as it assembles the gradient, unless it is 16-bit or cast before reducing
        # (then the sum, in reduce_dtype or fp32, is divided): 1/3 would round in 16 bits.
        self.scale_in_backward = handle.param_dtype == reduce_dtype and handle.param_dtype.itemsize > 2
        self.scale = 1 / divisor if self.scale_in_backward else 1.0
        self.shard_grad: torch.Tensor | None = None  # (shard_numel,): the reduced gradient
        # True from a forward that autograd records until this handle's gradient is reduced.
        self.awaiting = False
        # Per slot: whether backward gave it a gradient on this rank since the last reduction (FullViews sets
        # them), and whether its sharded view holds a gradient (one process's ``.grad is not None``).
        self.received = [False] * len(handle.slots)
        self._holds = [False] * len(handle.slots)
        # Whether the last reduction was a compiled graph's, which gave each sharded view its gradient (or none),
        # and the parts of it that the graph could not give (reduce_in_graph): (slot index, piece of shard_grad).
        self.reduced_in_graph = False
        self._left_out_of_graph: list[tuple[int, torch.Tensor]] = []
        self._pending = None  # an asynchronous reduce-scatter: wait() returns its shard_grad
        # Waits until the last reduced gradient copied home (offloaded, from a GPU) is there: the copies home go
        # in order on one stream, so the last one's wait covers this handle's earlier ones (offload.copy_home).
        self.wait_for_arrival = nothing_to_wait_for
        self.full_buffer: BorrowedBuffer | None = None  # where backward assembles the full gradient (handle sets)

    def _give_back_full_gradient(self) -> None:
        """The reduction is done with the full gradient: its memory goes back to the handle's buffers."""
        if self.full_buffer is not None:
            self.full_buffer.give_back()

    def reduce(self, asynchronous: bool = False) -> None:
        """Averages ``full_flat.grad`` over ranks into this rank's ``shard_grad`` and frees it.

        Reduce-scattered (summed) within the shard group, then all-reduced over the
        replicas if there are any; the gradient came out of backward already divided
        by the number of ranks, unless it is 16-bit (then the sum is divided here).
        A handle that got no gradient this backward contributes zeros, so every
        rank takes part in the same collectives. `asynchronous` only
        starts the reduce-scatter; ``finish_reduction()`` completes it and averages
        over the replicas (a compressed reduce-scatter, or a shard group of one rank, has
        nothing left to wait for by then).
        """
        handle = self.handle
        full_grad = handle.full_flat.grad  # (padded_numel,) of param_dtype
        if full_grad is None:
            full_grad = torch.zeros(handle.padded_numel, dtype=self.reduce_dtype, device=handle.compute_device)
        handle.full_flat.grad = None
        self.awaiting = False
        self.reduced_in_graph = False
        full_grad = full_grad.to(self.reduce_dtype)
        if asynchronous:
            self._pending = self.reduction.start_reduce_scatter(full_grad, handle.unit_name)
        else:
            self._accumulate(self._averaged(self.reduction.reduce_scatter(full_grad, handle.unit_name)))
            self._give_back_full_gradient()

    @property
    def in_flight(self) -> bool:
        """Whether an asynchronous reduce-scatter was started and not finished."""
        return self._pending is not None

    def finish_reduction(self) -> None:
        """Waits for an asynchronous reduce-scatter and adds its result to ``shard_grad``."""
        if self._pending is not None:
            shard_grad = self._pending.wait()
            self._pending = None
            self._give_back_full_gradient()
            self._accumulate(self._averaged(shard_grad))

    def reduce_in_graph(self, full_grad: torch.Tensor, sync: bool, used: list[bool]) -> torch.Tensor:
        """The compiled path's ``reduce`` (``traced.py``): a new (shard_numel,) gradient of the shard's dtype,
        averaged over the ranks, from backward's (padded_numel,) gradient of ``param_dtype``, already times
        ``scale`` (as ``FullViews`` gives it), which it reduces in place. Without `sync` (``no_sync``) the gradient is kept,
        as the eager path keeps it, in ``full_flat.grad`` (a copy: the graph may reuse its buffer), and zeros
        come back; a later synced backward adds what was kept before reducing.

        `used` (one flag per slot) says which parameters got a gradient in the graph that calls it, which
        hands the others none (their ``.grad`` stays as it was: None after ``zero_grad``), as eager backward
        does. A parameter that got one in an earlier ``no_sync`` backward but none in this graph still has
        its part of the reduced gradient: it is handed over at the end of backward
        (``give_gradients_left_out_of_graph``), since the graph cannot."""
        handle = self.handle
        used_since_reduction = [before or now for before, now in zip(self.received, used)]
        self.shard_grad = None  # the graph adds to the views' gradients: no longer pieces of ours (_accumulate)
        kept = handle.full_flat.grad
        handle.full_flat.grad = None
        if not sync:
            self.received[:] = used_since_reduction
            handle.full_flat.grad = full_grad.clone() if kept is None else kept.add_(full_grad)
            return torch.zeros(handle.shard_numel, dtype=handle.shard.dtype, device=handle.shard.device)
        if kept is not None:
            full_grad.add_(kept)
        shard_grad = self._averaged(self.reduction.reduce_scatter(full_grad.to(self.reduce_dtype), handle.unit_name))
        shard_grad = self._home(shard_grad)
        self.wait_for_arrival()  # read below, and by the graph
        self._left_out_of_graph = [(index, piece.clone()) for index, (piece, before, now)
                                   in enumerate(zip(shard_grad.split(handle.shard_pieces), used_since_reduction,
                                                    used))
                                   if before and not now]
        self.received[:] = [False] * len(handle.slots)
        self.reduced_in_graph = True
        return shard_grad

    def give_gradients_left_out_of_graph(self) -> None:
        """Adds to the sharded views the gradients that a compiled graph reduced but could not hand them
        (``reduce_in_graph``)."""
        for index, piece in self._left_out_of_graph:
            view = self.handle.sharded_views[index]
            view.grad = piece if view.grad is None else view.grad.add_(piece)
        self._left_out_of_graph = []

    @property
    def unsharded_bytes(self) -> int:
        """Memory held by a full-size gradient kept for a later reduction (``no_sync``)."""
        grad = self.handle.full_flat.grad
        return 0 if grad is None or self.handle.aliases_shard else grad.numel() * grad.element_size()

    def _home(self, shard_grad: torch.Tensor) -> torch.Tensor:
        """A reduced gradient shard where and as the shard is kept: copied to host memory where offloaded, cast
        to the shard's dtype (a no-op where it is both already). From a GPU the copy may still be on its way:
        read it only after ``wait_for_arrival()``."""
        home, self.wait_for_arrival = self.handle.offload.copy_home(shard_grad, self.handle.shard)
        return home

    def _averaged(self, shard_grad: torch.Tensor) -> torch.Tensor:
        """A reduce-scattered gradient summed over the replicas too and, unless backward scaled it, divided."""
        self.reduction.all_reduce_over_replicas(shard_grad, self.handle.unit_name)
        if not self.scale_in_backward and self.divisor > 1:
            shard_grad.div_(self.divisor)
        return shard_grad

    def _accumulate(self, shard_grad: torch.Tensor) -> None:
        """Adds a reduced gradient to what the sharded views still hold, then exposes it through them."""
        views, pieces = self.handle.sharded_views, self.handle.shard_pieces
        shard_grad = self._home(shard_grad)
        if self.shard_grad is not None or any(view.grad is not None for view in views):
            self.wait_for_arrival()  # what is held meets the new gradient on the host: both must be there
        self.release_cleared_by_user()
        if self.shard_grad is None:
            self.shard_grad = shard_grad
            for view, piece in zip(views, self.shard_grad.split(pieces)):
                if view.grad is not None:  # given by a compiled graph (reduce_in_graph), not a piece of ours
                    piece += view.grad
        else:
            self.shard_grad += shard_grad
        for view, piece in zip(views, self.shard_grad.split(pieces)):
            view.grad = piece

    def drop_unused(self, used_on_some_rank: list[bool]) -> None:
        """After a reduction: a parameter that no rank used since the last ``zero_grad`` has ``.grad`` None, as in
        one process, so that optimizers leave it alone (no weight decay, no momentum step)."""
        for index, (used, view) in enumerate(zip(used_on_some_rank, self.handle.sharded_views)):
            self._holds[index] = self._holds[index] or used
            if not self._holds[index]:
                view.grad = None
        self.received[:] = [False] * len(self.received)

    def release_cleared_by_user(self) -> None:
        """``optimizer.zero_grad()`` sets the views' ``.grad`` to None: their part of ``shard_grad`` is gone too."""
        slots, views = self.handle.slots, self.handle.sharded_views
        for index, view in enumerate(views):
            if view.grad is None:
                self._holds[index] = False
        if self.shard_grad is None:
            return
        cleared = [slot for slot, view in zip(slots, views) if view.grad is None and slot.shard_stop > slot.shard_start]
        holding = [slot for slot in slots if slot.shard_stop > slot.shard_start]
        if len(cleared) == len(holding):
            self.shard_grad = None
            return
        for slot in cleared:
            self.shard_grad[slot.shard_start:slot.shard_stop].zero_()

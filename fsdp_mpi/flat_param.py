"""A unit's parameters flattened into one padded buffer, of which each rank keeps 1/N.

One handle holding parameters ``a`` (6 elements) and ``b`` (3 elements) on 4 ranks::

    full_flat (padded_numel = 12):  a a a a a a b b b 0 0 0
    shards:                         [rank 0][rank 1][rank 2][rank 3]   (shard_numel = 3)

``flat_param`` (an ``nn.Parameter`` of ``shard_numel`` elements) is all a rank keeps
between uses: ``model.parameters()`` yields it and the optimizer updates it, so
optimizer state is sharded too without the optimizer knowing.

``full_flat`` is the gathered buffer. Its storage exists only between ``unshard()``
and ``reshard()``; in between the storage is released (resized to zero bytes), not
merely dereferenced, so it is really returned to the allocator. While it exists, the
module's original parameter attributes are views into it. Autograd therefore sums
the gradient of every use (tied weights, a unit run twice) into one ``full_flat.grad``,
which ``reduce_gradient()`` reduce-scatters into ``flat_param.grad``.

Every rank must flatten the same parameters in the same order, or the all-gather
would silently mix up parameters; the unit checks this across ranks at wrap time.
"""

from dataclasses import dataclass

import torch
from torch import nn

from fsdp_mpi.comm import Communicator

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
    """Where one original parameter lives inside the flat buffer."""

    uses: tuple[ParamUse, ...]  # more than one for tied parameters
    shape: torch.Size
    offset: int
    numel: int


class FlatParamHandle:
    """Owns the flat shard of some parameters of one unit, all of one dtype and ``requires_grad``.

    Args:
        params: each original parameter with every place it is used, in an order
            that is identical on every rank.
        comm: the communicator whose ranks share the shards.
        unit_name: for error messages (which unit owns a parameter).
    """

    def __init__(self, params: list[tuple[nn.Parameter, list[ParamUse]]], comm: Communicator, unit_name: str):
        first = params[0][0]
        self.comm = comm
        self.requires_grad = first.requires_grad
        self.slots: list[ParamSlot] = []
        offset = 0
        for param, uses in params:
            self.slots.append(ParamSlot(tuple(uses), param.shape, offset, param.numel()))
            offset += param.numel()
        self.numel = offset
        self.padded_numel = -(-offset // comm.world_size) * comm.world_size
        self.shard_numel = self.padded_numel // comm.world_size
        self.shard_offset = comm.rank * self.shard_numel

        with torch.no_grad():
            full = torch.zeros(self.padded_numel, dtype=first.dtype, device=first.device)
            for slot, (param, _) in zip(self.slots, params):
                full[slot.offset:slot.offset + slot.numel].copy_(param.reshape(-1))
            shard = full[self.shard_offset:self.shard_offset + self.shard_numel].clone()
        self.flat_param = nn.Parameter(shard, requires_grad=self.requires_grad)  # (shard_numel,)
        # On one rank the shard is the whole buffer: full_flat aliases it, so nothing is gathered or copied.
        self.aliases_shard = comm.world_size == 1
        if self.aliases_shard:
            self.full_flat = self.flat_param.data.requires_grad_(self.requires_grad)
        else:
            self.full_flat = torch.empty_like(full).requires_grad_(self.requires_grad)  # (padded_numel,)
            self._free_full_storage()
        # True from a forward that autograd records until this handle's gradient is reduced.
        self.awaiting_gradient = False
        self._pending_gather = None  # a prefetch in flight
        self._pending_reduction = None  # (Pending, shard_grad) of an asynchronous reduce-scatter

        for param, uses in params:
            setattr(param, OWNER_ATTRIBUTE, unit_name)
            for use in uses:
                del use.owner._parameters[use.attribute]

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
            self.comm.all_gather_into(self.full_flat.data, self.flat_param.data)

    def start_unshard(self) -> None:
        """Starts gathering without waiting (a prefetch); ``unshard()`` completes it."""
        if self._pending_gather is None and not self.is_unsharded:
            self._allocate_full_storage()
            self._pending_gather = self.comm.start_all_gather_into(self.full_flat.data, self.flat_param.data)

    def reshard(self) -> None:
        """Releases the gathered storage; only the shard remains on this rank."""
        if self._pending_gather is not None:  # MPI may still be writing into it
            self.unshard()
        if self.is_unsharded and not self.aliases_shard:
            self._free_full_storage()

    def _allocate_full_storage(self) -> None:
        self.full_flat.untyped_storage().resize_(self.padded_numel * self.full_flat.element_size())

    def _free_full_storage(self) -> None:
        self.full_flat.untyped_storage().resize_(0)

    def point_attributes_at_full_flat(self, detached: bool = False) -> None:
        """Sets every use of every parameter to a fresh view into ``full_flat``.

        Called at each forward, so that the views belong to the graph autograd is
        recording. Backward re-gathers into the same storage and keeps these views:
        views made inside backward would not require grad, and activation
        checkpointing's recomputation must see the same tensors as the forward.
        One ``torch.split`` makes all views, so that backward assembles the flat
        gradient in one concatenation instead of one zero-padded copy per parameter.
        `detached` views are plain tensors that users may edit in place.
        """
        source = self.full_flat.detach() if detached else self.full_flat
        pieces = torch.split(source, [slot.numel for slot in self.slots] + [self.padded_numel - self.numel])
        for slot, piece in zip(self.slots, pieces):
            view = piece.view(slot.shape)
            for use in slot.uses:
                setattr(use.owner, use.attribute, view)

    # ------------------------------------------------------------ gradients

    def reduce_gradient(self, asynchronous: bool = False) -> None:
        """Averages ``full_flat.grad`` over ranks into this rank's ``flat_param.grad`` and frees it.

        A handle that got no gradient this backward contributes zeros, so every
        rank takes part in the same collectives. `asynchronous` only starts the
        reduce-scatter; ``finish_gradient_reduction()`` completes it.
        """
        full_grad = self.full_flat.grad
        if full_grad is None:
            full_grad = torch.zeros(self.padded_numel, dtype=self.flat_param.dtype, device=self.flat_param.device)
        self.full_flat.grad = None
        self.awaiting_gradient = False
        if self.aliases_shard:
            self._accumulate(full_grad)  # one rank: the mean over ranks is the gradient itself
            return
        shard_grad = torch.empty_like(self.flat_param.data)  # (shard_numel,)
        if asynchronous:
            # The Pending keeps no reference to full_grad; this tuple does, until MPI has read it.
            pending = self.comm.start_reduce_scatter_mean(shard_grad, full_grad.contiguous())
            self._pending_reduction = (pending, shard_grad, full_grad)
        else:
            self.comm.reduce_scatter_mean(shard_grad, full_grad.contiguous())
            self._accumulate(shard_grad)

    def finish_gradient_reduction(self) -> None:
        """Waits for an asynchronous reduce-scatter and adds its result to ``flat_param.grad``."""
        if self._pending_reduction is not None:
            pending, shard_grad, _full_grad = self._pending_reduction
            pending.wait()
            self._pending_reduction = None
            self._accumulate(shard_grad)

    def _accumulate(self, shard_grad: torch.Tensor) -> None:
        if self.flat_param.grad is None:
            self.flat_param.grad = shard_grad
        else:
            self.flat_param.grad += shard_grad

    # ------------------------------------------------------------ full views for state dicts

    def write_back_shard(self) -> None:
        """Copies this rank's part of the (possibly edited) full parameters into its shard."""
        if self.aliases_shard:
            return
        with torch.no_grad():
            self.flat_param.copy_(self.full_flat.data[self.shard_offset:self.shard_offset + self.shard_numel])

    def full_tensors(self):
        """Yields (slot, full tensor view) for every parameter; only valid while unsharded."""
        for slot in self.slots:
            yield slot, self.full_flat.data[slot.offset:slot.offset + slot.numel].view(slot.shape)

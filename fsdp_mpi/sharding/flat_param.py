"""A unit's parameters flattened into one padded buffer, of which each rank keeps 1/N.

Where each parameter lies in the buffer, and which part a rank keeps, is the
layout (``flat_layout.py``, whose diagram shows it); a handle is that layout
with the memory behind it, and its gradient's side is ``flat_gradient.py``.
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
The full views are made once and bound, in each forward, to a new ``FullViews`` autograd node
(``full_views.py``), whose backward writes their gradients into one flat gradient already multiplied
by 1/N, which ``FlatGradient`` reduce-scatters into each sharded view's ``.grad``. Under ``Compression``
(``compression.py``) the gather moves the encoded fp32 shard and decodes it into ``full_flat``. Which of
these collectives a handle uses is chosen once, when it is built (``collectives.py``). State dicts and
``summon_full_params`` gather the shards themselves into a separate buffer
(``gather_masters()``), never ``full_flat``.
"""

import torch
from torch import nn

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.compression import Compression
from fsdp_mpi.sharding.collectives import choose_gather, choose_reduction
from fsdp_mpi.sharding.flat_gradient import FlatGradient
from fsdp_mpi.sharding.flat_layout import OWNER_ATTRIBUTE, FlatLayout, ParamSlot, ParamUse
from fsdp_mpi.sharding.full_views import FullViews
from fsdp_mpi.sharding.host_memory import BorrowedBuffer, buffers_for
from fsdp_mpi.sharding.offload import CPUOffload


class FlatParamHandle(FlatLayout):
    """Owns the flat shard of some parameters of one unit, all of one dtype and ``requires_grad``: their
    layout (``FlatLayout``) with the shard, the gathered buffer and the views behind it, and ``gradient``.

    Args:
        params: each original parameter with every place it is used, in an order
            that is identical on every rank.
        comm: the communicator whose ranks share the shards (the shard group).
        unit_name: for error messages (which unit owns a parameter) and the collective log; the
            root renames it to the unit's module path once the whole model is wrapped.
        param_dtype: the dtype gathered and computed with (None: the parameters' own).
        reduce_dtype: the dtype gradients are averaged in (None: the parameters' own).
        device: where the unit computes (None: where the parameters are). Parameters on the ``meta``
            device (deferred initialisation) need it; their shard starts as zeros, to be filled by
            ``copy_into_shard()``.
        replicas: the ranks holding this same shard in other shard groups (HYBRID_SHARD,
            NO_SHARD), over which each reduced gradient is then averaged; None: none.
        compression: how gathered weights and reduced gradients travel (``compression.py``; floating-point
            parameters only); None: in ``param_dtype`` and ``reduce_dtype``.
        offload: where the shard, its gradient and so the optimizer state live (``offload.py``); None: where
            the unit computes.
    """

    def __init__(self, params: list[tuple[nn.Parameter, list[ParamUse]]], comm: Communicator, unit_name: str,
                 param_dtype: torch.dtype | None = None, reduce_dtype: torch.dtype | None = None,
                 device: torch.device | None = None, replicas: Communicator | None = None,
                 compression: Compression | None = None, offload: CPUOffload | None = None):
        first = params[0][0]
        self.compute_device = torch.device(device if device is not None else first.device)
        self.offload = offload = offload or CPUOffload()
        self.comm = comm
        self.replicas = replicas
        self.unit_name = unit_name
        self.requires_grad = first.requires_grad
        low_precision_applies = first.is_floating_point()
        self.param_dtype = param_dtype if param_dtype and low_precision_applies else first.dtype
        compression = compression if compression is not None and low_precision_applies else Compression()
        super().__init__([(param.shape, uses) for param, uses in params], comm.world_size, comm.rank)
        self.gather = choose_gather(comm, compression.weight_codec)  # how full_flat is filled from the shards
        divisor = comm.world_size * (replicas.world_size if replicas is not None else 1)  # ranks averaged over
        self.gradient = FlatGradient(self, choose_reduction(comm, replicas, compression.gradient_codec), divisor,
                                     reduce_dtype if reduce_dtype and low_precision_applies else first.dtype)

        # (shard_numel,): the padding stays zero. Offloaded, it is in host memory and full_flat on the device.
        self.shard = offload.zeros(self.shard_numel, first.dtype, self.compute_device)
        self.copies_to_device = offload.copies_to_device(self.compute_device)
        if not first.is_meta:
            for slot, (param, _) in zip(self.slots, params):
                self.copy_into_shard(slot, param.detach())
        self.reuse_buffers(comes_back=True)  # the unit says otherwise once it knows (lifecycle.py)
        # A gather that moves nothing (one rank), unless it casts or the shard is elsewhere: full_flat aliases
        # the shard, nothing is copied.
        self.aliases_shard = (not self.gather.communicates and self.param_dtype == self.shard.dtype
                              and self.shard.device == self.compute_device)
        if self.aliases_shard:
            # .data, not .detach(): its own version counter, so the optimizer's in-place step on the shard
            # leaves the kept full views (use_full_views) valid, as a separate buffer on N ranks would.
            self.full_flat = self.shard.data.requires_grad_(self.requires_grad)
        else:
            self.full_flat = torch.empty(self.padded_numel, dtype=self.param_dtype, device=self.compute_device)
            self.full_flat.requires_grad_(self.requires_grad)
            self.full_flat.untyped_storage().resize_(0)  # (padded_numel,) of param_dtype while gathered
        self._full_views: tuple[torch.Tensor, ...] | None = None  # full-shape views into full_flat, one per slot
        self._pending_gather = None  # a prefetch in flight: wait() completes it

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
            self.gather.into(self.full_flat.data, self.shard, self.unit_name)

    def start_unshard(self) -> None:
        """Starts gathering without waiting (a prefetch); ``unshard()`` completes it."""
        if self._pending_gather is None and not self.is_unsharded:
            self._allocate_full_storage()
            self._pending_gather = self.gather.start_into(self.full_flat.data, self.shard, self.unit_name)

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
        self.buffers = buffers_for(self.compute_device, comes_back)
        # Holds the full gradient that backward assembles until its reduction is done, where the reduction makes
        # a new shard of it (not where the full gradient is the shard's: one rank).
        self.gradient.full_buffer = (None if self.gradient.reduction.gradient_is_its_own_shard
                                     else BorrowedBuffer(self.buffers, self.compute_device))

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
                self._full_views = self.split_full(self.full_flat.detach())
        if new_forward and self.requires_grad and torch.is_grad_enabled():
            FullViews.apply(self.full_flat, self._full_views, self.gradient.scale, self.gradient.received,
                            self.gradient.full_buffer)
        self.install_full_views(self._full_views)

    @property
    def communicates_nothing(self) -> bool:
        """One rank and no replicas: the shard is the whole buffer, and its gradient is the average already."""
        return not self.gather.communicates and not self.gradient.reduction.communicates

    # ------------------------------------------------------------ writing values into the shard

    def copy_into_shard(self, slot: ParamSlot, full_value: torch.Tensor) -> None:
        """Copies the part of one parameter's full value (any shape of ``slot.numel`` elements) that this rank keeps."""
        if slot.shard_stop > slot.shard_start:
            start = self.shard_offset + slot.shard_start - slot.offset  # into the flattened parameter
            with torch.no_grad():
                self.shard[slot.shard_start:slot.shard_stop].copy_(
                    full_value.reshape(-1)[start:start + slot.shard_stop - slot.shard_start])

    def write_back_shard(self, full: torch.Tensor) -> None:
        """Copies this rank's part of `full` (from ``gather_masters()``, possibly edited) into its shard."""
        with torch.no_grad():
            self.shard.copy_(full[self.shard_offset:self.shard_offset + self.shard_numel])

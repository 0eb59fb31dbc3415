"""Collectives among the ranks of one node through memory they all map (``shared_slots.py``): MPI only
says when, the bytes never go through it.

MPI's shared-memory path copies every byte twice through its own cells, and
cannot read device memory at all without a CUDA-aware build; staging through the
host moves 1-5 GB/s on a GPU node (docs/gpu.md). Here each rank writes its
contribution once into its own slot, and every rank reads what it needs straight
from its peers' slots: host memory on the CPU, device memory through CUDA IPC on
a GPU (device-to-device copies, at the GPU's bandwidth).

A collective is cut into *exchanges* of at most one slot each. One exchange::

    wait until every rank has read my slot s        GPU: their events      host: implied (below)
      (this one too: a sum reads its own slot, perhaps on another stream)
    write my contribution into my slot s
    mark slot s written                             GPU: my event
    MPI barrier                                     every rank has written (host order)
    wait until the peers' slots s are written       GPU: their events
    read from the peers' slots s                    copies, and sums in rank order
    mark slot s read                                GPU: my event

Slots alternate, 0, 1, 0, ...: a rank writes slot s again two exchanges later,
after the barrier of the exchange between, which no peer enters before it has
read slot s. So one barrier per exchange suffices. On the GPU the barrier only
orders the host's *queueing* of work; the events make each stream wait for
exactly the peer work it reads, and the host never waits for the device.

Sums are taken in rank order (in fp32 for 16-bit values, rounded once), so every
rank computes the same bits: replicas that all-reduce stay identical.
"""

import torch
from mpi4py import MPI

from fsdp_mpi.communication.mpi_buffers import SUM_IN_FP32
from fsdp_mpi.communication.shared_slots import DeviceSlots, HostSlots, SharedSlotsError
from fsdp_mpi.communication.staging import chunk_bounds

# The most one exchange moves per rank. On the host, chunks that stay near the caches; on a GPU, large enough
# that copies run at full bandwidth, small enough that two slots per rank cost little of its memory.
HOST_EXCHANGE_BYTES = 2**20
DEVICE_EXCHANGE_BYTES = 64 * 2**20


def open_node_transport(mpi_comm, device: torch.device, exchange_bytes: int | None = None):
    """A ``NodeTransport`` for `device`'s tensors if every rank of `mpi_comm` is on this node and the node's
    memory can be shared, else None; and one line saying which, and why. Collective over `mpi_comm`.

    A GPU named without an index (``cuda``) is the current one, as torch reads it."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    node = mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, mpi_comm.Get_rank())
    on_this_node = node.Get_size()
    if on_this_node != mpi_comm.Get_size():
        node.Free()
        return None, f"the ranks span several nodes ({on_this_node} of {mpi_comm.Get_size()} on this one)"
    try:
        if device.type == "cuda":
            slots = DeviceSlots(node, device, exchange_bytes or DEVICE_EXCHANGE_BYTES)
        else:
            slots = HostSlots(node, exchange_bytes or HOST_EXCHANGE_BYTES)
    except SharedSlotsError as refused:  # raised on every rank alike
        node.Free()
        return None, f"the ranks could not share memory ({refused})"
    where = ("device memory, mapped through CUDA IPC: device-to-device copies" if device.type == "cuda"
             else "a host segment that every rank maps: one copy in, one copy out")
    return NodeTransport(node, slots), f"the {node.Get_size()} ranks of this node exchange through {where}"


class NodeTransport:
    """All-gather, reduce-scatter, all-reduce, all-to-all and broadcast over one node's shared slots.

    Buffers are 1-D and contiguous, checked by the ``Communicator`` that calls these. On a GPU
    the work is queued on the current stream (the caller's, or the communication thread's).
    """

    def __init__(self, node_comm, slots: HostSlots | DeviceSlots):
        self.node_comm, self.slots = node_comm, slots
        self.rank, self.world = node_comm.Get_rank(), node_comm.Get_size()
        self._next_slot = 0

    def reserve(self, nbytes: int) -> None:
        """Grows the slots now (collective) to what a collective whose full buffer (every rank's part) has
        `nbytes` needs, so that they do not grow in the middle of a step, near its peak of memory: a
        reduce-scatter writes all of it into a slot, or the slot's limit of it per exchange."""
        self.slots.ensure(min(nbytes, self.slots.limit))

    def close(self) -> None:
        """Gives the slots and the node's communicator back (collective)."""
        self.slots.close()
        self.node_comm.Free()

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full (W * S,) <- every rank's shard (S,), in rank order."""
        full_by_rank = full.view(self.world, shard.numel())
        for a, b in chunk_bounds(shard.numel(), self._numel_per_exchange(shard, rows=1)):
            def write(mine):  # and this rank's own part, while the peers write theirs
                _typed(mine, shard.dtype, b - a).copy_(shard[a:b])
                if full_by_rank[self.rank, a:b].data_ptr() != shard[a:b].data_ptr():
                    full_by_rank[self.rank, a:b].copy_(shard[a:b])

            def read(peer):
                for rank in range(self.world):
                    if rank != self.rank:
                        full_by_rank[rank, a:b].copy_(_typed(peer(rank), shard.dtype, b - a))
            self._exchange((b - a) * shard.element_size(), write, read)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """shard (S,) <- the sum over ranks of their full[rank * S:(rank + 1) * S]."""
        full_by_rank = full.view(self.world, shard.numel())
        for a, b in chunk_bounds(shard.numel(), self._numel_per_exchange(shard, rows=self.world)):
            def write(mine):  # the rows the peers sum: row j goes to rank j
                rows = _typed(mine, full.dtype, self.world * (b - a)).view(self.world, b - a)
                for rank in range(self.world):
                    if rank != self.rank:
                        rows[rank].copy_(full_by_rank[rank, a:b])

            def read(peer):
                parts = [full_by_rank[self.rank, a:b] if rank == self.rank
                         else _typed(peer(rank), full.dtype, self.world * (b - a)).view(self.world, b - a)[self.rank]
                         for rank in range(self.world)]
                _sum_in_rank_order(parts, shard[a:b])
            self._exchange(self.world * (b - a) * full.element_size(), write, read)

    def all_reduce(self, flat: torch.Tensor) -> None:
        """flat (N,) <- its element-wise sum over ranks, the same bits on every rank."""
        for a, b in chunk_bounds(flat.numel(), self._numel_per_exchange(flat, rows=1)):
            def write(mine):
                _typed(mine, flat.dtype, b - a).copy_(flat[a:b])

            def read(peer):  # own values from the slot too: every rank sums the same tensors in the same order
                _sum_in_rank_order([_typed(peer(rank), flat.dtype, b - a) for rank in range(self.world)], flat[a:b])
            self._exchange((b - a) * flat.element_size(), write, read)

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        """received (W * K,) <- chunk `rank` of every rank's sent (W * K,), in rank order."""
        sent_by_rank, received_by_rank = sent.view(self.world, -1), received.view(self.world, -1)
        for a, b in chunk_bounds(sent_by_rank.shape[1], self._numel_per_exchange(sent, rows=self.world)):
            def write(mine):
                rows = _typed(mine, sent.dtype, self.world * (b - a)).view(self.world, b - a)
                for rank in range(self.world):
                    if rank != self.rank:
                        rows[rank].copy_(sent_by_rank[rank, a:b])

            def read(peer):
                for rank in range(self.world):
                    source = (sent_by_rank[self.rank, a:b] if rank == self.rank else
                              _typed(peer(rank), sent.dtype, self.world * (b - a)).view(self.world, b - a)[self.rank])
                    received_by_rank[rank, a:b].copy_(source)
            self._exchange(self.world * (b - a) * sent.element_size(), write, read)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        """flat (N,) <- root's."""
        for a, b in chunk_bounds(flat.numel(), self._numel_per_exchange(flat, rows=1)):
            def write(mine):
                if self.rank == root:
                    _typed(mine, flat.dtype, b - a).copy_(flat[a:b])

            def read(peer):
                if self.rank != root:
                    flat[a:b].copy_(_typed(peer(root), flat.dtype, b - a))
            self._exchange((b - a) * flat.element_size(), write, read)

    def _numel_per_exchange(self, tensor: torch.Tensor, rows: int) -> int:
        """Elements per rank and row that one exchange moves, `rows` rows to a slot."""
        return max(1, self.slots.limit // (rows * tensor.element_size()))

    def _exchange(self, nbytes: int, write, read) -> None:
        """One exchange (the module's docstring): write(my slot), barrier, read(peer slot by rank)."""
        slots = self.slots
        slots.ensure(nbytes)
        slot, self._next_slot = self._next_slot, 1 - self._next_slot
        slots.wait_until_read(slot)
        write(slots.mine(slot))
        slots.written(slot)
        self.node_comm.Barrier()
        slots.wait_until_written(slot)
        read(lambda rank: slots.peer(rank, slot))
        slots.read(slot)


def _typed(memory: torch.Tensor, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """The first `numel` elements of `dtype` in a slot's bytes."""
    return memory[:numel * dtype.itemsize].view(dtype)


def _sum_in_rank_order(parts: list[torch.Tensor], out: torch.Tensor) -> None:
    """out <- parts[0] + parts[1] + ..., left to right, in fp32 for 16-bit values (rounded once at the end).

    `out` may be one of the parts' memory; a part on another GPU is copied over first.
    """
    parts = [part if part.device == out.device else part.to(out.device, non_blocking=True) for part in parts]
    if len(parts) == 2 and out.dtype not in SUM_IN_FP32:
        torch.add(parts[0], parts[1], out=out)  # element by element: out may alias either part
        return
    total = parts[0].to(torch.float32 if out.dtype in SUM_IN_FP32 else out.dtype, copy=True)
    for part in parts[1:]:
        total.add_(part)
    out.copy_(total)

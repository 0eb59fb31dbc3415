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

Sums are taken in rank order (in fp32 for 16-bit values, rounded once: ``machinery/sums.py``),
so every rank computes the same bits: replicas that all-reduce stay identical.

The all-gather, reduce-scatter and all-to-all move *blocks*: each rank's part is
an (n, S) block (n = 1 for a flat collective), read from or written into views
of any strides, so that a collective in two levels (``two_level.py``) can hand
over the rows of its full buffer that the node level moves without copying them
into place first. An exchange moves a chunk of columns of every row of a block.
"""

import torch

from fsdp_mpi.communication.settings import DEVICE_EXCHANGE_BYTES, HOST_EXCHANGE_BYTES, NODE_TRANSPORT
from fsdp_mpi.communication.machinery.chunks import chunk_bounds, elements_per_chunk
from fsdp_mpi.communication.transports.shared_slots import DeviceSlots, HostSlots, SharedSlotsError
from fsdp_mpi.communication.machinery.sums import sum_in_rank_order
from fsdp_mpi.communication.transports.transport import Offer, Transport


def open_node_transport(node_comm, device: torch.device, exchange_bytes: int | None = None):
    """A ``NodeTransport`` over `node_comm` (ranks of one node) for `device`'s tensors where the node's memory can
    be shared, else None; and what it moves through, or why not. Collective over `node_comm`. A GPU named
    without an index (``cuda``) is the current one, as torch reads it."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    try:
        if device.type == "cuda":
            slots = DeviceSlots(node_comm, device, exchange_bytes or DEVICE_EXCHANGE_BYTES)
        else:
            slots = HostSlots(node_comm, exchange_bytes or HOST_EXCHANGE_BYTES)
    except SharedSlotsError as refused:  # raised on every rank alike
        return None, f"the ranks could not share memory ({refused})"
    where = ("device memory, mapped through CUDA IPC: device-to-device copies" if device.type == "cuda"
             else "a host segment that every rank maps: one copy in, one copy out")
    return NodeTransport(node_comm, slots), where


class NodeTransport(Transport):
    """All-gather, reduce-scatter, all-reduce, all-to-all and broadcast over one node's shared slots.

    On a GPU the work is queued on the current stream (the caller's, or the communication thread's).
    """

    route = "node"

    @classmethod
    def offer(cls, comm, node_comm, device: torch.device) -> Offer:
        """Itself over `node_comm` (ranks of one node) for `device`'s tensors, unless `comm`'s settings turn it
        off or the node's memory cannot be shared; what it moves through, or why not. Collective over
        `node_comm`."""
        if not comm.node_transport:
            return Offer(None, f"{NODE_TRANSPORT.name}=0")
        return Offer(*open_node_transport(node_comm, device, comm.node_exchange_bytes))

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

    def runs_started_on_the_worker(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda  # queueing device copies behind barriers; a host copy is the CPU's work anyway

    # ----------------------------------------------------------------- flat: every rank's part is one row

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        self.all_gather_blocks(full.view(self.world, 1, -1), shard.view(1, -1))

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        self.reduce_scatter_blocks(shard.view(1, -1), full.view(self.world, 1, -1))

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        self.all_to_all_blocks(received.view(self.world, 1, -1), sent.view(self.world, 1, -1))

    def all_reduce(self, flat: torch.Tensor) -> None:
        """flat (N,) <- its element-wise sum over ranks, the same bits on every rank."""
        for a, b in chunk_bounds(flat.numel(), self._columns_per_exchange(flat, rows=1)):
            def write(mine):
                _typed(mine, flat.dtype, b - a).copy_(flat[a:b])

            def read(peer):  # own values from the slot too: every rank sums the same tensors in the same order
                sum_in_rank_order([_typed(peer(rank), flat.dtype, b - a) for rank in range(self.world)], flat[a:b])
            self._exchange((b - a) * flat.element_size(), write, read)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        for a, b in chunk_bounds(flat.numel(), self._columns_per_exchange(flat, rows=1)):
            def write(mine):
                if self.rank == root:
                    _typed(mine, flat.dtype, b - a).copy_(flat[a:b])

            def read(peer):
                if self.rank != root:
                    flat[a:b].copy_(_typed(peer(root), flat.dtype, b - a))
            self._exchange((b - a) * flat.element_size(), write, read)

    # ----------------------------------------------------------------- blocks of n rows, views of any strides

    def all_gather_blocks(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        """out (W, n, S) <- every rank's block mine (n, S): out[rank] is rank's."""
        rows, width = mine.shape
        for a, b in chunk_bounds(width, self._columns_per_exchange(mine, rows)):
            def write(slot):  # and this rank's own block, while the peers write theirs
                _rows(slot, mine.dtype, rows, b - a).copy_(mine[:, a:b])
                if out[self.rank, :, a:b].data_ptr() != mine[:, a:b].data_ptr():
                    out[self.rank, :, a:b].copy_(mine[:, a:b])

            def read(peer):
                for rank in range(self.world):
                    if rank != self.rank:
                        out[rank, :, a:b].copy_(_rows(peer(rank), mine.dtype, rows, b - a))
            self._exchange(rows * (b - a) * mine.element_size(), write, read)

    def reduce_scatter_blocks(self, out: torch.Tensor, parts: torch.Tensor) -> None:
        """out (n, S) <- the sum over ranks, in rank order, of their parts[this rank] (each rank's parts: (W, n, S)).
        `out` may be fp32 for 16-bit parts: the sum is then not rounded at all."""
        _, rows, width = parts.shape
        for a, b in chunk_bounds(width, self._columns_per_exchange(parts, self.world * rows)):
            def write(slot):  # the blocks the peers sum: block j goes to rank j
                blocks = _blocks(slot, parts.dtype, self.world, rows, b - a)
                for rank in range(self.world):
                    if rank != self.rank:
                        blocks[rank].copy_(parts[rank, :, a:b])

            def read(peer):
                received = [parts[self.rank, :, a:b] if rank == self.rank
                            else _blocks(peer(rank), parts.dtype, self.world, rows, b - a)[self.rank]
                            for rank in range(self.world)]
                sum_in_rank_order(received, out[:, a:b])
            self._exchange(self.world * rows * (b - a) * parts.element_size(), write, read)

    def all_to_all_blocks(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        """received (W, n, c) <- from every rank its sent[this rank] (each rank's sent: (W, n, c)), in rank order."""
        _, rows, width = sent.shape
        for a, b in chunk_bounds(width, self._columns_per_exchange(sent, self.world * rows)):
            def write(slot):
                blocks = _blocks(slot, sent.dtype, self.world, rows, b - a)
                for rank in range(self.world):
                    if rank != self.rank:
                        blocks[rank].copy_(sent[rank, :, a:b])

            def read(peer):
                for rank in range(self.world):
                    source = (sent[self.rank, :, a:b] if rank == self.rank
                              else _blocks(peer(rank), sent.dtype, self.world, rows, b - a)[self.rank])
                    received[rank, :, a:b].copy_(source)
            self._exchange(self.world * rows * (b - a) * sent.element_size(), write, read)

    # ----------------------------------------------------------------- one exchange

    def _columns_per_exchange(self, tensor: torch.Tensor, rows: int) -> int:
        """Columns of `rows` rows that one exchange moves: a slot's worth."""
        return elements_per_chunk(tensor.element_size(), self.slots.limit, rows)

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


def _rows(memory: torch.Tensor, dtype: torch.dtype, rows: int, width: int) -> torch.Tensor:
    """A slot's bytes as (rows, width) of `dtype`."""
    return _typed(memory, dtype, rows * width).view(rows, width)


def _blocks(memory: torch.Tensor, dtype: torch.dtype, count: int, rows: int, width: int) -> torch.Tensor:
    """A slot's bytes as (count, rows, width) of `dtype`: one block for each rank."""
    return _typed(memory, dtype, count * rows * width).view(count, rows, width)

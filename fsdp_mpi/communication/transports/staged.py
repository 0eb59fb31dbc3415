"""Collectives on memory that MPI cannot read: a pipeline through pinned host buffers, chunk by chunk.

Without a CUDA-aware MPI, a device buffer reaches MPI through host memory.
Copying a whole message out, calling MPI, and copying the result back would
leave the copy engines and MPI idle in turn. Here a message is cut into chunks,
and each chunk moves on as soon as it can (the pipelining of MVAPICH2-GPU,
Wang et al., ISC 2011)::

    copy stream:  out 0  out 1  out 2  out 3
    host (MPI):          MPI 0  MPI 1  MPI 2  MPI 3
    copy stream:                in 0   in 1   in 2   in 3

so MPI's work on chunk i overlaps the device-to-host copy of chunk i+1 and the
host-to-device copy of chunk i-1. Three chunks are in flight at most, in a ring
of three chunk-sized host slots: pinned memory is bounded by the chunk size.

The copies run on a stream of their own, which first waits for what the compute
stream has queued so far; the compute stream then waits, through an event, for
the last copy back. The host waits only for each chunk's copy out, which MPI is
about to read: it never synchronises the compute stream. Every device tensor
handed in is used only by work that the compute stream is ordered after, so the
caching allocator may reuse its memory as soon as the caller lets it go.

On the CPU (``FSDP_MPI_FORCE_STAGING=1``, which the tests use to run this path
without a GPU) the same chunks go through the same host buffers with plain copies.

``Staged`` is the transport: MPI's part of each chunk is ``direct.MpiCalls`` on
the host buffers, 16-bit values are summed through fp32 copies, and a started
collective runs on the communication thread (host work end to end).
"""

from functools import partial
from typing import Callable

import torch

from fsdp_mpi.communication.machinery.chunks import chunk_bounds, elements_per_chunk
from fsdp_mpi.communication.transports.direct import MpiCalls
from fsdp_mpi.communication.machinery.sums import summed_in_fp32
from fsdp_mpi.communication.transports.transport import Offer, Transport, WidenedForMpi

MpiStep = Callable[..., None]  # MPI's part for one chunk, on host buffers, the output first


RING_SLOTS = 3  # chunks in flight: one being copied out, one in MPI, one being copied back


class StagedCollectives:
    """Runs one communicator's collectives through its reusable host buffers, `chunk_numel` elements per rank
    at a time; the caller supplies MPI's part for one chunk (``MpiStep``).

    Each collective's host memory is a ring of ``RING_SLOTS`` chunk-sized slots, chunk i in slot i % 3: the
    pinned memory a communicator keeps is bounded by the chunk size, whatever the largest message.
    """

    def __init__(self):
        self.buffers = HostStagingBuffers()
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._host_buffers_read = None  # a CUDA event: the last collective's copies back have read the host buffers

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, chunk_numel: int, gather: MpiStep) -> None:
        """full (W * S,) <- every rank's shard (S,); ``gather(full (W * c,), shard (c,))`` moves one chunk."""
        world = full.numel() // shard.numel()
        full_by_rank = full.view(world, -1)
        chunks = chunk_bounds(shard.numel(), chunk_numel)
        send = self._ring("all_gather_send", chunks, 1, shard.dtype)
        recv = self._ring("all_gather_recv", chunks, world, full.dtype)
        self._pipelined(full, chunks,
                        lambda pipeline, slot, a, b: pipeline.copy_out(send(slot, a, b), shard[a:b]),
                        lambda slot, a, b: gather(recv(slot, a, b), send(slot, a, b)),
                        lambda pipeline, slot, a, b: pipeline.copy_in(full_by_rank[:, a:b],
                                                                      recv(slot, a, b).view(world, b - a)))

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, chunk_numel: int, reduce: MpiStep) -> None:
        """shard (S,) <- the sum over ranks of their part of `full` (W * S,); ``reduce(shard (c,), full (W * c,))``."""
        world = full.numel() // shard.numel()
        full_by_rank = full.view(world, -1)
        chunks = chunk_bounds(shard.numel(), chunk_numel)
        send = self._ring("reduce_scatter_send", chunks, world, full.dtype)
        recv = self._ring("reduce_scatter_recv", chunks, 1, shard.dtype)
        self._pipelined(full, chunks,
                        lambda pipeline, slot, a, b: pipeline.copy_out(send(slot, a, b).view(world, b - a),
                                                                       full_by_rank[:, a:b]),
                        lambda slot, a, b: reduce(recv(slot, a, b), send(slot, a, b)),
                        lambda pipeline, slot, a, b: pipeline.copy_in(shard[a:b], recv(slot, a, b)))

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor, world: int, chunk_numel: int,
                   exchange: MpiStep) -> None:
        """received (W * K,) <- chunk `rank` of every rank's `sent` (W * K,);
        ``exchange(received (W * c,), sent (W * c,))`` moves the same c columns of all W chunks at once."""
        sent_by_rank, received_by_rank = sent.view(world, -1), received.view(world, -1)
        chunks = chunk_bounds(sent_by_rank.shape[1], chunk_numel)
        send = self._ring("all_to_all_send", chunks, world, sent.dtype)
        recv = self._ring("all_to_all_recv", chunks, world, received.dtype)
        self._pipelined(sent, chunks,
                        lambda pipeline, slot, a, b: pipeline.copy_out(send(slot, a, b).view(world, b - a),
                                                                       sent_by_rank[:, a:b]),
                        lambda slot, a, b: exchange(recv(slot, a, b), send(slot, a, b)),
                        lambda pipeline, slot, a, b: pipeline.copy_in(received_by_rank[:, a:b],
                                                                      recv(slot, a, b).view(world, b - a)))

    def in_place(self, tensor: torch.Tensor, chunk_numel: int, step: MpiStep, *, send: bool = True,
                 receive: bool = True, slot: str = "in_place") -> None:
        """``step(host (c,))`` on each chunk of the 1-D `tensor`, in place (all-reduce, broadcast).

        `send`: this rank's values are copied out first; `receive`: the result is copied back.
        """
        chunks = chunk_bounds(tensor.numel(), chunk_numel)
        host = self._ring(slot, chunks, 1, tensor.dtype)
        self._pipelined(tensor, chunks,
                        lambda pipeline, i, a, b: pipeline.copy_out(host(i, a, b), tensor[a:b]) if send else _nothing,
                        lambda i, a, b: step(host(i, a, b)),
                        lambda pipeline, i, a, b: pipeline.copy_in(tensor[a:b], host(i, a, b)) if receive else _nothing)

    def _ring(self, name: str, chunks: list[tuple[int, int]], rows: int, dtype: torch.dtype):
        """``RING_SLOTS`` host slots of `rows` x the widest chunk; returns (slot, a, b) -> that slot's first
        rows * (b - a) elements, for chunk [a, b)."""
        width = max(b - a for a, b in chunks)
        ring = self.buffers.get(name, RING_SLOTS * rows * width, dtype).view(RING_SLOTS, rows * width)
        return lambda slot, a, b: ring[slot, :rows * (b - a)]

    def _pipelined(self, tensor: torch.Tensor, chunks: list[tuple[int, int]], copy_out, mpi_step, copy_in) -> None:
        """Moves the chunks through the ring: copies out run up to ``RING_SLOTS`` chunks ahead of MPI.

        A slot is written again only after the copy back that last read it: on the copy stream a copy out is
        queued after that copy back, and before MPI fills a slot the host waits for both.
        """
        with _Pipeline(self, tensor) as pipeline:
            copied_out, copied_back = {}, {}
            for i in range(min(RING_SLOTS, len(chunks))):
                copied_out[i] = copy_out(pipeline, i, *chunks[i])
            for i, (a, b) in enumerate(chunks):
                slot = i % RING_SLOTS
                copied_out.pop(i)()
                if i >= RING_SLOTS:
                    copied_back.pop(i - RING_SLOTS)()
                mpi_step(slot, a, b)
                copied_back[i] = copy_in(pipeline, slot, a, b)
                if (ahead := i + RING_SLOTS) < len(chunks):
                    copied_out[ahead] = copy_out(pipeline, slot, *chunks[ahead])

    def copy_stream(self, device: torch.device) -> "torch.cuda.Stream":
        if device not in self._copy_streams:
            self._copy_streams[device] = torch.cuda.Stream(device)
        return self._copy_streams[device]


def _nothing() -> None:
    pass


class _Pipeline:
    """One staged collective's copies: on the copy stream for a CUDA tensor, plain copies on the CPU."""

    def __init__(self, staged: StagedCollectives, tensor: torch.Tensor):
        self.staged, self.cuda = staged, tensor.is_cuda
        if self.cuda:
            self.compute = torch.cuda.current_stream(tensor.device)
            self.copy = staged.copy_stream(tensor.device)

    def __enter__(self) -> "_Pipeline":
        # The last device collective's copies back may still read the host buffers that this one (on the GPU or,
        # with staging forced, a CPU tensor's) is about to overwrite.
        if self.staged._host_buffers_read is not None:
            self.staged._host_buffers_read.synchronize()
            self.staged._host_buffers_read = None
        if self.cuda:
            self.copy.wait_stream(self.compute)  # what the collective sends has been computed
        return self

    def copy_out(self, host: torch.Tensor, source: torch.Tensor) -> Callable[[], None]:
        """Starts copying `source` into `host`; returns what waits until `host` holds it."""
        return self._copy(host, source)

    def copy_in(self, target: torch.Tensor, host: torch.Tensor) -> Callable[[], None]:
        """Starts copying `host` into `target` (on the copy stream: the compute stream waits for it at the end);
        returns what waits until `host` has been read."""
        return self._copy(target, host)

    def _copy(self, target: torch.Tensor, source: torch.Tensor) -> Callable[[], None]:
        """target <- source, on the copy stream for a CUDA tensor; returns what waits until it is done."""
        if not self.cuda:
            target.copy_(source)
            return _nothing
        with torch.cuda.stream(self.copy):
            target.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy)
        return copied.synchronize

    def __exit__(self, *_exception) -> None:
        if self.cuda:
            copied_back = torch.cuda.Event()
            copied_back.record(self.copy)
            self.compute.wait_event(copied_back)
            self.staged._host_buffers_read = copied_back


class Staged(WidenedForMpi, Transport):
    """Every collective through `pipeline`'s pinned host buffers, `chunk_bytes` per rank and chunk (within MPI's
    count limit, `max_elements_per_message`)."""

    route = "staged"

    @classmethod
    def offer(cls, comm, mpi_comm, refused_direct: Offer) -> Offer:
        """Itself over `mpi_comm`, with `comm`'s settings, for memory MPI does not read in place: it can carry any,
        and the direct transport's refusal says why it is needed."""
        return Offer(cls(mpi_comm, comm.staging_chunk_bytes, comm.max_elements_per_message), refused_direct.line)

    def __init__(self, mpi_comm, chunk_bytes: int, max_elements_per_message: int):
        self.mpi, self.world = MpiCalls(mpi_comm), mpi_comm.Get_size()
        self.pipeline = StagedCollectives()
        self.chunk_bytes, self.max_elements = chunk_bytes, max_elements_per_message

    def _chunk(self, tensor: torch.Tensor) -> int:
        return elements_per_chunk(tensor.element_size(), self.chunk_bytes, max_elements=self.max_elements)

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        self.pipeline.all_gather(full, shard, self._chunk(shard), self.mpi.all_gather)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        shard, full, finish = self.widened_for_sum(shard, full)
        self.pipeline.reduce_scatter(shard, full, self._chunk(shard), self.mpi.reduce_scatter)
        if finish is not None:
            finish()

    def all_reduce(self, flat: torch.Tensor) -> None:
        summed = flat.float() if summed_in_fp32(flat.dtype) else flat
        self.pipeline.in_place(summed, self._chunk(summed), self.mpi.all_reduce, slot="all_reduce")
        if summed is not flat:
            flat.copy_(summed)

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        self.pipeline.all_to_all(received, sent, self.world, self._chunk(sent), self.mpi.all_to_all)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        rank = self.mpi.mpi_comm.Get_rank()
        self.pipeline.in_place(flat, self._chunk(flat), partial(self.mpi.broadcast, root=root), send=rank == root,
                               receive=rank != root, slot="broadcast")

    def runs_started_on_the_worker(self, tensor: torch.Tensor) -> bool:
        return True

    @property
    def staging_slots(self) -> list[str]:
        return self.pipeline.buffers.slots


class HostStagingBuffers:
    """Reusable host buffers, one per named slot, grown on demand and never shrunk.

    Pinned when CUDA is present so that device-to-host copies run at full speed, asynchronously; kept between
    steps, so that no collective pins memory anew.
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, slot: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Returns a host tensor of exactly `numel` elements of `dtype` for `slot`."""
        nbytes = numel * dtype.itemsize
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self._buffers[slot] = buffer
        return buffer[:nbytes].view(dtype)

    @property
    def slots(self) -> list[str]:
        """The slots used so far."""
        return sorted(self._buffers)

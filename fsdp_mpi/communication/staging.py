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
host-to-device copy of chunk i-1.

The copies run on a stream of their own, which first waits for what the compute
stream has queued so far; the compute stream then waits, through an event, for
the last copy back. The host waits only for each chunk's copy out, which MPI is
about to read: it never synchronises the compute stream. Every device tensor
handed in is used only by work that the compute stream is ordered after, so the
caching allocator may reuse its memory as soon as the caller lets it go.

On the CPU (``FSDP_MPI_FORCE_STAGING=1``, which the tests use to run this path
without a GPU) the same chunks go through the same host buffers with plain copies.
"""

from typing import Callable

import torch

from fsdp_mpi.communication.gpu_support import HostStagingBuffers

MpiStep = Callable[..., None]  # MPI's part for one chunk, on host buffers


def chunk_bounds(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """[start, stop) of consecutive chunks of at most `chunk_numel` elements covering `numel` (one if 0)."""
    return [(start, min(start + chunk_numel, numel)) for start in range(0, max(numel, 1), chunk_numel)]


class StagedCollectives:
    """Runs one communicator's collectives through its reusable host buffers, `chunk_numel` elements per rank
    at a time; the caller supplies MPI's part for one chunk (``MpiStep``)."""

    def __init__(self):
        self.buffers = HostStagingBuffers()
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._host_buffers_read = None  # a CUDA event: the last collective's copies back have read the host buffers

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, chunk_numel: int, gather: MpiStep) -> None:
        """full (W * S,) <- every rank's shard (S,); ``gather(send (c,), recv (W * c,))`` moves one chunk."""
        shard_numel = shard.numel()
        world = full.numel() // shard_numel
        send = self.buffers.get("all_gather_send", shard_numel, shard.dtype)
        recv = self.buffers.get("all_gather_recv", full.numel(), full.dtype)  # chunk after chunk, each (W, c)
        full_by_rank = full.view(world, shard_numel)
        chunks = chunk_bounds(shard_numel, chunk_numel)
        with _Pipeline(self, full) as pipeline:
            copied_out = [pipeline.copy_out(send[a:b], shard[a:b]) for a, b in chunks]
            for (a, b), wait_until_copied in zip(chunks, copied_out):
                wait_until_copied()
                gather(send[a:b], recv[world * a:world * b])
                pipeline.copy_in(full_by_rank[:, a:b], recv[world * a:world * b].view(world, b - a))

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor, chunk_numel: int, reduce: MpiStep) -> None:
        """shard (S,) <- the sum over ranks of their part of `full` (W * S,); ``reduce(send (W * c,), recv (c,))``."""
        shard_numel = shard.numel()
        world = full.numel() // shard_numel
        send = self.buffers.get("reduce_scatter_send", full.numel(), full.dtype)  # chunk after chunk, each (W, c)
        recv = self.buffers.get("reduce_scatter_recv", shard_numel, shard.dtype)
        full_by_rank = full.view(world, shard_numel)
        chunks = chunk_bounds(shard_numel, chunk_numel)
        with _Pipeline(self, full) as pipeline:
            copied_out = [pipeline.copy_out(send[world * a:world * b].view(world, b - a), full_by_rank[:, a:b])
                          for a, b in chunks]
            for (a, b), wait_until_copied in zip(chunks, copied_out):
                wait_until_copied()
                reduce(send[world * a:world * b], recv[a:b])
                pipeline.copy_in(shard[a:b], recv[a:b])

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor, world: int, chunk_numel: int,
                   exchange: MpiStep) -> None:
        """received (W * K,) <- chunk `rank` of every rank's `sent` (W * K,); ``exchange(send (W * c,), recv (W * c,))``
        moves the same c columns of all W chunks at once."""
        send = self.buffers.get("all_to_all_send", sent.numel(), sent.dtype)  # chunk after chunk, each (W, c)
        recv = self.buffers.get("all_to_all_recv", received.numel(), received.dtype)
        sent_by_rank, received_by_rank = sent.view(world, -1), received.view(world, -1)
        chunks = chunk_bounds(sent_by_rank.shape[1], chunk_numel)
        with _Pipeline(self, sent) as pipeline:
            copied_out = [pipeline.copy_out(send[world * a:world * b].view(world, b - a), sent_by_rank[:, a:b])
                          for a, b in chunks]
            for (a, b), wait_until_copied in zip(chunks, copied_out):
                wait_until_copied()
                exchange(send[world * a:world * b], recv[world * a:world * b])
                pipeline.copy_in(received_by_rank[:, a:b], recv[world * a:world * b].view(world, b - a))

    def in_place(self, tensor: torch.Tensor, chunk_numel: int, step: MpiStep, *, send: bool = True,
                 receive: bool = True, slot: str = "in_place") -> None:
        """``step(host (c,))`` on each chunk of the 1-D `tensor`, in place (all-reduce, broadcast).

        `send`: this rank's values are copied out first; `receive`: the result is copied back.
        """
        host = self.buffers.get(slot, tensor.numel(), tensor.dtype)
        chunks = chunk_bounds(tensor.numel(), chunk_numel)
        with _Pipeline(self, tensor) as pipeline:
            copied_out = [pipeline.copy_out(host[a:b], tensor[a:b]) if send else _nothing for a, b in chunks]
            for (a, b), wait_until_copied in zip(chunks, copied_out):
                wait_until_copied()
                step(host[a:b])
                if receive:
                    pipeline.copy_in(tensor[a:b], host[a:b])

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
        if not self.cuda:
            host.copy_(source)
            return _nothing
        with torch.cuda.stream(self.copy):
            host.copy_(source, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self.copy)
        return copied.synchronize

    def copy_in(self, target: torch.Tensor, host: torch.Tensor) -> None:
        """Copies `host` into `target` (on the copy stream: the compute stream waits for it at the end)."""
        if not self.cuda:
            target.copy_(host)
            return
        with torch.cuda.stream(self.copy):
            target.copy_(host, non_blocking=True)

    def __exit__(self, *_exception) -> None:
        if self.cuda:
            copied_back = torch.cuda.Event()
            copied_back.record(self.copy)
            self.compute.wait_event(copied_back)
            self.staged._host_buffers_read = copied_back

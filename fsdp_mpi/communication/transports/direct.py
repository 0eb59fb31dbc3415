"""MPI reads the tensors where they are: host memory, or device memory where MPI is CUDA-aware.

A tensor goes to mpi4py as its address (``machinery/mpi_buffers.py``); before MPI reads or
writes device memory the host waits for the stream that produced it (an event,
never the whole device), and so for every piece a cut message copies on the
stream: MPI works on the host's time, not the stream's. A message longer than
MPI's count limit (a C int of elements per rank) is cut into several. 16-bit values reach MPI's sums as fp32
copies. A started collective of host memory in one message is MPI's nonblocking
call, which MPI moves on inside later MPI calls, or in the background where the
library has a progress thread or offloads to hardware; on device memory it runs
on the communication thread, which waits for the stream while the main thread
goes on queueing kernels.
"""

import torch
from mpi4py import MPI

from fsdp_mpi.communication.machinery.chunks import chunk_bounds
from fsdp_mpi.communication.machinery.mpi_buffers import as_bits, summed, wait_for_producer
from fsdp_mpi.communication.machinery.mpi_library import describe_device_path
from fsdp_mpi.communication.machinery.sums import summed_in_fp32
from fsdp_mpi.communication.transports.transport import Offer, Transport, WidenedForMpi


def mpi_reads_in_place(comm, device: torch.device) -> bool:
    """Whether MPI reads and writes `device`'s memory itself (host memory; device memory where MPI is
    CUDA-aware), unless `comm` forces staging: what collectives and messages alike go by."""
    return not comm.force_staging and (device.type == "cpu" or comm.cuda_aware)


class MpiCalls:
    """MPI's part of each collective on buffers it can read, in one message each; the output first, as torch's."""

    def __init__(self, mpi_comm):
        self.mpi_comm = mpi_comm

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        self.mpi_comm.Allgather(as_bits(shard), as_bits(full))

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        (sent, op), (received, _) = summed(full), summed(shard)
        self.mpi_comm.Reduce_scatter_block(sent, received, op=op)

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        self.mpi_comm.Alltoall(as_bits(sent), as_bits(received))

    def all_reduce(self, tensor: torch.Tensor) -> None:
        values, op = summed(tensor)
        self.mpi_comm.Allreduce(MPI.IN_PLACE, values, op=op)

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self.mpi_comm.Bcast(as_bits(tensor), root=root)


class Direct(WidenedForMpi, Transport):
    """Args:
        mpi_comm: the ranks.
        max_elements_per_message: MPI's count limit per rank (tests make it small to exercise the cutting).
        device_reductions_in_background: False under Open MPI, whose nonblocking reductions crash on device
            buffers: a started reduce-scatter of device memory then runs to its end when started.
    """

    route = "direct"

    @classmethod
    def offer(cls, comm, mpi_comm, device: torch.device) -> Offer:
        """Itself over `mpi_comm`, with `comm`'s settings, where MPI reads `device`'s memory in place; else None
        and why (``describe_device_path``: the library's answer, and what overrode it)."""
        through = (describe_device_path(comm.cuda_awareness, comm.force_staging) if device.type == "cuda"
                   else "host buffers go to MPI" + (" through staging buffers" if comm.force_staging else ""))
        if not mpi_reads_in_place(comm, device):
            return Offer(None, through)
        return Offer(cls(mpi_comm, comm.max_elements_per_message, comm.device_reductions_in_background), through)

    def __init__(self, mpi_comm, max_elements_per_message: int, device_reductions_in_background: bool = True):
        self.mpi = MpiCalls(mpi_comm)
        self.world = mpi_comm.Get_size()
        self.max_elements = max_elements_per_message
        self.device_reductions_in_background = device_reductions_in_background

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        wait_for_producer(shard)
        pieces = chunk_bounds(shard.numel(), self.max_elements)
        if len(pieces) == 1:
            self.mpi.all_gather(full, shard)
            return
        full_by_rank = full.view(self.world, -1)
        for a, b in pieces:
            gathered = torch.empty(self.world, b - a, dtype=full.dtype, device=full.device)
            wait_for_producer(gathered)  # the last piece's copy out of what may be this memory has run
            self.mpi.all_gather(gathered, shard[a:b])
            full_by_rank[:, a:b].copy_(gathered)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        shard, full, finish = self.widened_for_sum(shard, full)
        wait_for_producer(full)
        full_by_rank = full.view(self.world, -1)
        for a, b in chunk_bounds(shard.numel(), self.max_elements):
            if b - a == shard.numel():
                self.mpi.reduce_scatter(shard, full)
                continue
            piece = full_by_rank[:, a:b].contiguous()  # (world, b - a)
            wait_for_producer(piece)  # the copy has run
            self.mpi.reduce_scatter(shard[a:b], piece)
        if finish is not None:
            finish()

    def all_reduce(self, flat: torch.Tensor) -> None:
        summed = flat.float() if summed_in_fp32(flat.dtype) else flat
        wait_for_producer(summed)
        for a, b in chunk_bounds(summed.numel(), self.max_elements):
            self.mpi.all_reduce(summed[a:b])
        if summed is not flat:
            flat.copy_(summed)

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        wait_for_producer(sent)
        sent_by_rank, received_by_rank = sent.view(self.world, -1), received.view(self.world, -1)
        pieces = chunk_bounds(sent_by_rank.shape[1], self.max_elements)
        if len(pieces) == 1:
            self.mpi.all_to_all(received, sent)
            return
        for a, b in pieces:
            receive = torch.empty(self.world, b - a, dtype=received.dtype, device=received.device)
            send = sent_by_rank[:, a:b].contiguous()
            wait_for_producer(send)  # its copy, and the last piece's copy out of what may be `receive`, have run
            self.mpi.all_to_all(receive, send)
            received_by_rank[:, a:b].copy_(receive)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        wait_for_producer(flat)
        for a, b in chunk_bounds(flat.numel(), self.max_elements):
            self.mpi.broadcast(flat[a:b], root)

    def runs_started_on_the_worker(self, tensor: torch.Tensor) -> bool:
        return tensor.is_cuda

    def nonblocking_all_gather(self, full: torch.Tensor, shard: torch.Tensor):
        if shard.numel() > self.max_elements:
            return None

        def start():
            wait_for_producer(shard)
            return self.mpi.mpi_comm.Iallgather(as_bits(shard), as_bits(full))
        return start

    def nonblocking_reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor):
        if (shard.numel() > self.max_elements or summed_in_fp32(shard.dtype)
                or (full.is_cuda and not self.device_reductions_in_background)):
            return None

        def start():
            wait_for_producer(full)
            (sent, op), (received, _) = summed(full), summed(shard)
            return self.mpi.mpi_comm.Ireduce_scatter_block(sent, received, op=op)
        return start

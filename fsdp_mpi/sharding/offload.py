"""CPU offload: the sharded state in host memory, the device holding only what a unit computes with.

With ``FullyShardedDataParallel(..., cpu_offload=CPUOffload(offload_params=True))`` (torch FSDP's names):

    shard (the fp32 master copy) and its sharded views     host memory, pinned where the unit computes on a GPU
    each sharded view's .grad (the reduced gradient)       host memory: the reduction's shard copied home
    the optimizer's state                                  host memory: it steps the host views (a CPU optimizer)
    a unit's gathered weights, its full gradient           the compute device, only while the unit works

Before a unit's all-gather its shard is copied to the compute device (in the
dtype it computes in), and its reduced gradient shard is copied back as the
reduction produces it. The model's parameters are never moved to the device
whole: only its buffers go there, and each unit's shard is made from the host
copy. On a machine without a GPU the compute device is the host too, and the
copies cost nothing: the path is the same.

From pinned memory to a GPU and back, neither copy makes the host wait for the
compute the GPU still has queued (a plain ``.to()`` would: the host would stop
queueing kernels until the GPU caught up, once per unit and direction). Each
direction has a stream of its own, ordered by events, as FSDP2's offload does:

    to the device   the shard is final on the host (the host stepped it), so its
                    copy waits for nothing; the compute stream waits for the copy
                    (``on_device``), and so does the all-gather, started after it
    home            the copy waits for the reduction (an event on the stream that
                    produced it) and lands in new pinned memory; whoever reads the
                    gradient on the host waits for it (``copy_home``'s wait: the end
                    of backward, a step inside it, an accumulation)

On one rank there is no gather to wait for the copy to the device (a unit's
weights are the shard cast into the gathered buffer, ``collectives.LocalGather``),
and nothing would keep the host from writing the shard under a copy in flight:
that copy stays synchronous. ``FSDP_MPI_OFFLOAD_STREAMS=0`` makes every copy so,
to measure what the streams save (bench.py's ``+sync_copies``).
"""

from dataclasses import dataclass
from typing import Callable

import torch

from fsdp_mpi.communication.settings import OFFLOAD_STREAMS, read_flag


@dataclass(frozen=True)
class CPUOffload:
    """Whether the sharded parameters, their gradients and the optimizer state live in host memory.

    Args:
        offload_params: keep them in host memory (torch FSDP's ``CPUOffload(offload_params=True)``).
        pin_memory: page-locked host memory where the units compute on a GPU, so that copies to and from it run
            at full speed (torch FSDP2's ``CPUOffloadPolicy(pin_memory=True)``).
    """

    offload_params: bool = False
    pin_memory: bool = True

    def shard_device(self, compute_device: torch.device) -> torch.device:
        """Where a handle's shard lives when its unit computes on `compute_device`."""
        return torch.device("cpu") if self.offload_params else compute_device

    def copies_to_device(self, compute_device: torch.device) -> bool:
        """Whether shards live apart from `compute_device` (offloaded, and the units compute on a GPU): then
        every gather and reduction copies between the two memories, and the host is free while the device
        computes. On a CPU the two are one memory, so nothing is pinned and nothing is copied."""
        return self.offload_params and compute_device.type != "cpu"

    def zeros(self, numel: int, dtype: torch.dtype, compute_device: torch.device) -> torch.Tensor:
        """A new (numel,) shard of zeros where a unit computing on `compute_device` keeps it (``shard_device``),
        pinned where it is copied to and from that device."""
        pinned = self.pin_memory and self.copies_to_device(compute_device)
        return torch.zeros(numel, dtype=dtype, device=self.shard_device(compute_device), pin_memory=pinned)

    def copy_home(self, shard_grad: torch.Tensor, shard: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
        """A reduced gradient shard where and as `shard` is kept (its device and dtype), and what waits until it
        is there: the gradient's readers call it before they read. From a GPU into pinned host memory the copy
        runs behind the reduction on the stream home, and the wait is for that copy only; elsewhere the copy is
        made at once and the wait does nothing."""
        if not _on_copy_streams(shard, shard_grad.device):
            return shard_grad.to(shard.device, shard.dtype), nothing_to_wait_for
        stream = _copy_stream(shard_grad.device, "home")
        reduced = torch.cuda.Event()
        reduced.record(torch.cuda.current_stream(shard_grad.device))
        with torch.cuda.stream(stream):
            stream.wait_event(reduced)
            source = shard_grad.to(shard.dtype)  # cast on the GPU, by the copy's stream
            home = torch.empty(shard_grad.shape, dtype=shard.dtype, pin_memory=True)
            home.copy_(source, non_blocking=True)
        shard_grad.record_stream(stream)  # its memory is not the compute stream's again until the copy read it
        copied = torch.cuda.Event()
        copied.record(stream)
        return home, copied.synchronize


def on_device(tensor: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """`tensor` (a shard) on `device` in `dtype`, for a gather. From pinned host memory to a GPU it is copied on
    the stream to the device, which waits for nothing (the host has finished with the shard), and the current
    stream waits for the copy: the host does not. Elsewhere ``tensor.to(device, dtype)``."""
    if not _on_copy_streams(tensor, device):
        return tensor.to(device, dtype)
    stream = _copy_stream(device, "to the device")
    with torch.cuda.stream(stream):
        moved = tensor.to(device, non_blocking=True)
    current = torch.cuda.current_stream(device)
    current.wait_stream(stream)
    moved.record_stream(current)  # allocated on the copy's stream, used on this one
    return moved.to(dtype)


def _on_copy_streams(host: torch.Tensor, device: torch.device) -> bool:
    """Whether copies between `host` and `device` run on the copy streams: pinned host memory and a GPU (a copy
    from pageable memory cannot overlap anything), unless ``FSDP_MPI_OFFLOAD_STREAMS=0``."""
    return device.type == "cuda" and host.device.type == "cpu" and host.is_pinned() and read_flag(OFFLOAD_STREAMS)


def nothing_to_wait_for() -> None:
    """The wait of a copy made at once (``copy_home``'s, but from a GPU into pinned memory)."""


_COPY_STREAMS: dict[tuple[torch.device, str], "torch.cuda.Stream"] = {}


def _copy_stream(device: torch.device, direction: str) -> "torch.cuda.Stream":
    """The stream of one direction's copies on `device` (made once per process: each new stream takes the next
    of torch's pool)."""
    key = (torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device()), direction)
    if key not in _COPY_STREAMS:
        _COPY_STREAMS[key] = torch.cuda.Stream(key[0])
    return _COPY_STREAMS[key]

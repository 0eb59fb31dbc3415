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
"""

from dataclasses import dataclass

import torch


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

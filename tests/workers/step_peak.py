"""A training step's peak, by the kernel's count, with the allocator settings a user gets (launched with no
GLIBC_TUNABLES): what a step adds above the process before the model, against what it must hold.

The model: 8 residual blocks, one unit each, of 36 MiB of fp32 weights (above the 32 MiB beyond which glibc
maps every allocation fresh), and one row a rank, so that what a step holds is state, weights and gradients,
not activations. AdamW (torch's loop over parameters on a CPU).
"""

import torch
from common import ResidualBlock, output_path, write_json
from memory import Stack, reset_peak, resident_bytes
from mpi4py import MPI

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy
from fsdp_mpi.sharding.host_memory import buffers_for

WIDTH = 1536  # 8 blocks (memory.Stack's)


if __name__ == "__main__":
    comm = Communicator()
    x = torch.randn(1, WIDTH, generator=torch.Generator().manual_seed(comm.rank))
    torch.nn.Linear(WIDTH, WIDTH)(x).sum().backward()  # the kernels' first use, before the baseline
    torch.optim.AdamW([torch.zeros(1, requires_grad=True)])  # torch.optim's first use loads the compiler: code too
    before_model = resident_bytes()
    torch.manual_seed(0)
    model = FullyShardedDataParallel(Stack(width=WIDTH), comm=comm, auto_wrap_policy=ModuleWrapPolicy({ResidualBlock}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    steps_peaks, pooled_after_step = [], []
    for step in range(4):
        reset_peak()
        model(x).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # the sharded gradient is state: held at rest
        steps_peaks.append(resident_bytes("VmHWM") - before_model)
        pooled_after_step.append(buffers_for(x.device).allocated_bytes)
    handles = [h for m in model.modules() if isinstance(m, FullyShardedDataParallel) for h in m.handles]
    blocks = [h for h in handles if h.padded_numel > WIDTH + 1]
    report = {"step_peaks": steps_peaks, "pooled_after_step": pooled_after_step,
              "shard_bytes": sum(h.shard_numel * 4 for h in handles),
              "unit_bytes": max(h.padded_numel * 4 for h in blocks),
              "largest_shard_param_bytes": max(p.numel() * 4 for p in model.parameters())}
    reports = MPI.COMM_WORLD.gather(report)
    if comm.rank == 0:
        write_json(output_path(), reports)

"""Hugging Face Accelerate on a group the "fsdp_mpi" backend started first: ``Accelerator`` keeps a process group
that exists (its ``PartialState`` starts one only where none is), so what it wraps communicates through fsdp_mpi.

    mpiexec -n 2 python accelerate_backend.py OUT

On a CPU, Accelerate is distributed only when told ``cpu=True``: without it, under mpiexec and with the group
started, it takes each rank for a lone process (``DistributedType.NO``) and wraps nothing, so every rank trains
alone, without a word. With it, Accelerate never turns FSDP on either: asked for it (``fsdp_plugin=``), it keeps
its MULTI_CPU type and wraps the model in DDP, again without a word. This reports what it did both ways, and
one step's gradient on every rank against its closed form: the mean of each rank's own gradient, computed here
on an unwrapped copy (on 2 ranks DDP's (g0 / 2) + (g1 / 2) and the mean (g0 + g1) / 2 are the same bits).
"""

import copy

import torch
import torch.distributed as dist
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.state import AcceleratorState
from accelerate.utils import FullyShardedDataParallelPlugin
from common import output_path, write_json
from mpi4py import MPI
from torch import nn

import fsdp_mpi.distributed


def one_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, backward) -> dict[str, torch.Tensor]:
    backward(F.mse_loss(model(x), y))
    return {name.removeprefix("module."): parameter.grad.clone() for name, parameter in model.named_parameters()}


if __name__ == "__main__":
    fsdp_mpi.distributed.init_process_group()
    ours = dist.group.WORLD
    fsdp = FullyShardedDataParallelPlugin(fsdp_version=2)
    alone = Accelerator(fsdp_plugin=fsdp)
    without_cpu_flag = {"distributed type": str(alone.distributed_type), "processes": alone.num_processes}
    AcceleratorState._reset_state(reset_partial_state=True)  # Accelerate's state is one per process
    accelerator = Accelerator(cpu=True, fsdp_plugin=fsdp)
    world = MPI.COMM_WORLD
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 2))
    replica = copy.deepcopy(plain)
    generator = torch.Generator().manual_seed(1 + world.Get_rank())
    x, y = torch.randn(4, 6, generator=generator), torch.randn(4, 2, generator=generator)
    wrapped = accelerator.prepare(plain)
    gradient = one_step(wrapped, x, y, accelerator.backward)
    own = one_step(replica, x, y, lambda loss: loss.backward())
    everyone = world.allgather(own)
    mean = {name: sum(ranks[name] for ranks in everyone) / world.Get_size() for name in own}
    report = {
        "without cpu=True": without_cpu_flag,
        "the group it found is the one started before it": dist.group.WORLD is ours,
        "backend": dist.get_backend(),
        "distributed type": str(accelerator.distributed_type),
        "its process index is MPI's rank": accelerator.process_index == world.Get_rank(),
        "its number of processes is MPI's": accelerator.num_processes == world.Get_size(),
        "wrapped in": type(wrapped).__name__,
        "the wrapper's group": dist.get_backend(getattr(wrapped, "process_group", None)),
        "the gradient is the ranks' mean, to the bit": gradient.keys() == mean.keys() and all(
            torch.equal(gradient[name], mean[name]) for name in mean),
    }
    reports = world.gather(report)
    write_json(output_path(), reports)

"""Checks where parameter memory is held: shards only at rest, one unit (plus its ancestors) while computing."""

import gc
import os
import weakref

import torch
from common import ResidualBlock, gpt_batch, local_part, output_path, write_json
from mpi4py import MPI
from torch.utils.checkpoint import checkpoint

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy
from fsdp_mpi.sharding.flat_param import FlatParamHandle
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config


def live_tensor_bytes() -> int:
    """Bytes of host memory that live tensors hold, measured: every distinct storage that a live tensor object,
    or its ``.grad`` (held by autograd, not by a Python object of its own), refers to (views share their base's),
    whatever the sharding layer believes it holds. Between steps no autograd graph holds anything else."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor):
            for tensor in (obj, obj.grad):
                if tensor is not None and tensor.device.type == "cpu":
                    storage = tensor.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def gathered_units(units) -> list[int]:
    return [index for index, unit in enumerate(units) if any(h.gathered_bytes for h in unit.handles)]


class Recomputed(torch.nn.Module):
    """Calls `block` through activation checkpointing: its own call, hooks and all, runs again in backward."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def gathers_in_backward_under_checkpointing(comm: Communicator, inputs, targets) -> list[list[str]]:
    """Per step, the handles gathered during backward (by unit name, in order) when each block is called through
    ``torch.utils.checkpoint`` (as Hugging Face's gradient checkpointing calls its layers), with forward
    prefetch on: the block's forward runs again inside backward, through the unit's hooks, and must compute
    with what the backward gathered, prefetching and recording nothing."""
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    model.transformer.h = torch.nn.ModuleList(Recomputed(block) for block in model.transformer.h)
    sharded = FullyShardedDataParallel(model, comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
                                       forward_prefetch=True)
    gathered, allocate = [], FlatParamHandle._allocate_full_storage

    def counted(handle):
        if torch._C._current_graph_task_id() != -1:  # inside backward
            gathered.append(handle.unit_name)
        return allocate(handle)
    FlatParamHandle._allocate_full_storage = counted
    steps = []
    for _ in range(2):
        _, loss = sharded(inputs, targets)
        loss.backward()
        steps.append(list(gathered))
        gathered.clear()
    FlatParamHandle._allocate_full_storage = allocate
    return steps


def resident_bytes(field: str = "VmRSS") -> int:
    """This process's resident size now (VmRSS), or its peak since the last ``reset_peak()`` (VmHWM)."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith(f"{field}:"))


def reset_peak() -> int:
    """Restarts the kernel's peak-resident counter at the present size, and returns that size."""
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")
    return resident_bytes()


class Stack(torch.nn.Module):
    """Units much larger than their activations (one row a rank): what a step holds at its peak is weights and
    gradients, and the root's own parameters (a one-output head) are negligible."""

    def __init__(self, blocks: int = 8, width: int = 512):
        super().__init__()
        self.blocks = torch.nn.Sequential(*(ResidualBlock(width) for _ in range(blocks)))
        self.head = torch.nn.Linear(width, 1)

    def forward(self, x):
        return self.head(self.blocks(x)).square().mean()


def peak_of_a_step(comm: Communicator, prefetch: bool) -> dict:
    """The resident size that a training step adds at its peak, in forward and in backward, measured by the
    kernel (VmHWM, reset before each) on the third step, with one unit's gathered bytes to say how many units'
    worth that is. The launch sets glibc's mmap threshold, so that every tensor's memory is returned to the kernel
    when freed and the peak is what was allocated at once. Gradients accumulate from step to step (no zero_grad),
    so that the sharded gradient is held at rest and a step adds only what it frees again."""
    torch.manual_seed(0)
    model = FullyShardedDataParallel(Stack(), comm=comm, auto_wrap_policy=ModuleWrapPolicy({ResidualBlock}),
                                     forward_prefetch=prefetch, backward_prefetch=prefetch)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(1, 512, generator=torch.Generator().manual_seed(comm.rank))
    for _ in range(2):  # the first step records the order and makes the views; the second reaches steady state
        model(x).backward()
        optimizer.step()
    rest = reset_peak()
    loss = model(x)
    forward_peak = resident_bytes("VmHWM") - rest
    rest = reset_peak()
    loss.backward()
    backward_peak = resident_bytes("VmHWM") - rest
    unit = next(m for m in model.modules()
                if isinstance(m, FullyShardedDataParallel) and isinstance(m.module, ResidualBlock))
    peaks = MPI.COMM_WORLD.allgather((forward_peak, backward_peak))
    return {"unit_bytes": sum(h.padded_numel * h.full_flat.element_size() for h in unit.handles),
            "forward_peak": max(peak for peak, _ in peaks), "backward_peak": max(peak for _, peak in peaks)}


if __name__ == "__main__":
    comm = Communicator()
    torch.manual_seed(0)
    inputs, targets = gpt_batch(0, 128)
    before_model = live_tensor_bytes()  # with the batch: from here on, what tensors hold is the model's
    plain = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    unwrapped_bytes = sum(p.numel() * p.element_size() for p in plain.parameters())
    model = FullyShardedDataParallel(plain, comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    held_at_rest = live_tensor_bytes() - before_model  # the full parameters must be gone, only shards left
    units = [m for m in model.modules() if isinstance(m, FullyShardedDataParallel)]

    persistent = [
        {"padded_numel": h.padded_numel, "shard_bytes": h.shard.numel() * h.shard.element_size(),
         "gathered_bytes": h.gathered_bytes,
         "view_bytes": sum(s.shard_stop - s.shard_start for s in h.slots) * h.shard.element_size()}
        for unit in units for h in unit.handles
    ]
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())

    # Which units hold gathered storage while each block computes (0 is the root).
    seen_during_blocks = []
    for unit in units[1:]:
        unit.module.register_forward_pre_hook(lambda module, args: seen_during_blocks.append(gathered_units(units)))
    _, loss = model(local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank, comm.world_size))
    after_forward = gathered_units(units)
    loss.backward()
    after_backward = gathered_units(units)
    grad_numels = [p.grad.numel() for p in model.parameters() if p.requires_grad]
    with torch.no_grad():
        model(inputs[:2])
    after_no_grad_forward = gathered_units(units)
    seen_in_two_forwards = list(seen_during_blocks)  # what follows runs the blocks again

    # With forward prefetch, block i+1 is being gathered while block i computes (from the second step on).
    torch.manual_seed(0)
    prefetching = FullyShardedDataParallel(GPT2LMHeadModel(gpt2_config("gpt2-tiny")), comm=comm,
                                           auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), forward_prefetch=True)
    prefetch_units = [m for m in prefetching.modules() if isinstance(m, FullyShardedDataParallel)]
    seen_with_prefetch = []
    for unit in prefetch_units[1:]:
        unit.module.register_forward_pre_hook(
            lambda module, args: seen_with_prefetch.append(gathered_units(prefetch_units)))
    for _ in range(2):
        with torch.no_grad():
            prefetching(inputs[:2])

    under_checkpointing = gathers_in_backward_under_checkpointing(
        comm, local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank, comm.world_size))

    # Gradient accumulation: under no_sync every unit keeps its full-size gradient and nothing is reduced;
    # the next backward with sync reduces the sum, and the full-size gradients are gone.
    def gradient_bytes() -> dict:
        return {"unsharded": sum(h.gradient.unsharded_bytes for u in units for h in u.handles),
                "sharded": sum(h.gradient.shard_grad.numel() * 4 for u in units for h in u.handles
                               if h.gradient.shard_grad is not None)}

    model.zero_grad(set_to_none=True)
    local_inputs, local_targets = local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank,
                                                                                            comm.world_size)
    del prefetching, prefetch_units, unit, _, loss  # what tensors hold is the model's alone again
    with model.no_sync():
        model(local_inputs, local_targets)[1].backward()
    during_no_sync = gradient_bytes() | {"measured": live_tensor_bytes() - before_model}
    model(local_inputs, local_targets)[1].backward()
    after_sync = gradient_bytes() | {"measured": live_tensor_bytes() - before_model}

    # A wrapped model that its user drops, after a training step, leaves nothing behind (its units' hooks live
    # in C++, where a reference cycle through them would be out of the garbage collector's reach).
    dropped = FullyShardedDataParallel(GPT2LMHeadModel(gpt2_config("gpt2-tiny")), comm=comm,
                                       auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    dropped(local_inputs, local_targets)[1].backward()
    held_with_dropped = live_tensor_bytes()
    handles_of_dropped = [weakref.ref(h) for m in dropped.modules() if isinstance(m, FullyShardedDataParallel)
                          for h in m.handles]
    del dropped
    freed = held_with_dropped - live_tensor_bytes()  # which collects garbage first
    dropped_model = {"handles_alive": sum(ref() is not None for ref in handles_of_dropped), "bytes_freed": freed}

    step_peaks = ({"no_prefetch": peak_of_a_step(comm, prefetch=False), "prefetch": peak_of_a_step(comm, prefetch=True)}
                  if os.path.exists("/proc/self/clear_refs") else None)  # Linux's, to reset the peak

    write_json(output_path(), {
        "step_peaks": step_peaks,
        "dropped_model": dropped_model,
        "during_no_sync": during_no_sync,
        "after_sync": after_sync,
        "seen_with_prefetch": seen_with_prefetch,
        "gathered_in_backward_under_checkpointing": under_checkpointing,
        "world_size": comm.world_size,
        "unwrapped_bytes": unwrapped_bytes,
        "parameter_bytes": parameter_bytes,
        "persistent": persistent,
        "held_at_rest": held_at_rest,
        "seen_during_blocks": seen_in_two_forwards,
        "after_forward": after_forward,
        "after_backward": after_backward,
        "after_no_grad_forward": after_no_grad_forward,
        "grad_numels": grad_numels,
        "shard_numels": [p.numel() for p in model.parameters() if p.requires_grad],
    })

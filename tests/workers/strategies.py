"""HYBRID_SHARD and NO_SHARD: the same training as one process, the bytes each rank keeps, and checkpoints
that load under any other strategy and rank count.

    mpiexec -n 4 python strategies.py OUT CHECKPOINT_DIR    (HYBRID_SHARD in groups of 2: 2 "nodes" of 2)
"""

import os
import sys
from collections import Counter

import torch
from common import gpt_batch, local_part, output_path, write_json
from equivalence import check_run, run

from fsdp_mpi import (Communicator, Compression, FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy,
                      full_state_dict, load_checkpoint, save_checkpoint)
from fsdp_mpi.sharding.lifecycle import units_with_names
from fsdp_mpi.communication.settings import HYBRID_GROUP_SIZE
from fsdp_mpi.sharding.strategy import ShardGroups
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config

GROUP = 2
STRATEGIES = {
    "hybrid": {"sharding_strategy": ShardingStrategy.HYBRID_SHARD, "hybrid_group_size": GROUP},
    "no_shard": {"sharding_strategy": ShardingStrategy.NO_SHARD},
}


def kept_bytes(comm: Communicator, **wrap) -> dict:
    """Per rank: the bytes of shards and of gradient shards after a step, of the whole model's parameters,
    and of the step's collectives as the model's communicator counts them (those of groups split from it too)."""
    moved_before = dict(comm.bytes_moved)
    torch.manual_seed(0)
    plain = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    model = FullyShardedDataParallel(plain, comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), **wrap)
    handles = [h for m in model.modules() if isinstance(m, FullyShardedDataParallel) for h in m.handles]
    inputs, targets = gpt_batch(0, 128)
    _, loss = model(local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank, comm.world_size))
    loss.backward()
    return {"shard_bytes": sum(h.shard.numel() * h.shard.element_size() for h in handles),
            "grad_bytes": sum(h.gradient.shard_grad.numel() * h.gradient.shard_grad.element_size() for h in handles),
            "gathered_after_step": sum(h.gathered_bytes for h in handles),
            "padded_bytes": sum(h.padded_numel * h.shard.element_size() for h in handles),
            "parameter_tensors": sum(len(h.slots) for h in handles if h.requires_grad),
            "shard_group_size": handles[0].comm.world_size,
            "replicas": 1 if handles[0].replicas is None else handles[0].replicas.world_size,
            "moved": {operation: count - moved_before.get(operation, 0) for operation, count in comm.bytes_moved.items()}}


def checkpoint_loads_under_full_shard(comm: Communicator, directory: str) -> bool:
    """Trains a step under HYBRID_SHARD, saves, and loads into FULL_SHARD: the same full state on every rank."""
    torch.manual_seed(0)
    hybrid = FullyShardedDataParallel(GPT2LMHeadModel(gpt2_config("gpt2-tiny")), comm=comm,
                                      auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), **STRATEGIES["hybrid"])
    optimizer = torch.optim.AdamW(hybrid.parameters(), lr=1e-2)
    inputs, targets = gpt_batch(1, 128)
    _, loss = hybrid(local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank, comm.world_size))
    loss.backward()
    optimizer.step()
    save_checkpoint(directory, hybrid, optimizer)
    saved = full_state_dict(hybrid, rank0_only=False)
    torch.manual_seed(1)  # other initial weights, overwritten by the load
    full = FullyShardedDataParallel(GPT2LMHeadModel(gpt2_config("gpt2-tiny")), comm=comm,
                                    auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    load_checkpoint(directory, full, torch.optim.AdamW(full.parameters(), lr=1e-2))
    loaded = full_state_dict(full, rank0_only=False)
    return sorted(saved) == sorted(loaded) and all(torch.equal(saved[k], loaded[k]) for k in saved)


def compressed_hybrid(comm: Communicator, block_size: int = 256) -> dict:
    """HYBRID_SHARD with int8 weights and gradients (their bounds are checked in workers/compression.py): two
    AdamW steps leave the replicas' shards bit-identical and lower the loss, and a step moves the closed form's
    bytes. Per handle of S elements per rank, G ranks per group and R replicas, with int8(n) = n + 4 ceil(n / B):
    gathers of G int8(S) (twice but for the root), an all-to-all of G int8(S) in the group, then the replicas'
    all-to-all and all-gather of G chunks of ceil(S / R): R int8(ceil(S / R)) each."""
    torch.manual_seed(0)
    model = FullyShardedDataParallel(GPT2LMHeadModel(gpt2_config("gpt2-tiny")), comm=comm,
                                     auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
                                     compression=Compression("int8", "int8", block_size), **STRATEGIES["hybrid"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    inputs, targets = gpt_batch(0, 128)
    losses = []
    for _ in range(2):
        comm.bytes_moved.clear()
        _, loss = model(local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank, comm.world_size))
        loss.backward()
        losses.append(comm.all_reduce_sum_float(loss.item()))
        moved = dict(comm.bytes_moved)
        optimizer.step()
        optimizer.zero_grad()

    def int8(numel: int) -> int:
        return numel + 4 * -(-numel // block_size)

    expected = Counter()
    for name, unit in units_with_names(model):
        for handle in unit.handles:
            group, replicas, shard = handle.comm.world_size, handle.replicas.world_size, handle.shard_numel
            replica_chunk = replicas * int8(-(-shard // replicas))
            expected["all_gather"] += (1 if name == "" else 2) * group * int8(shard) + replica_chunk
            expected["all_to_all"] += group * int8(shard) + replica_chunk
            expected["all_reduce"] += 4 * len(handle.slots)
    shards = comm.all_gather_object([handle.shard for _, unit in units_with_names(model) for handle in unit.handles])
    replica = shards[(comm.rank + GROUP) % comm.world_size]
    return {"bytes_as_closed_form": moved == dict(expected), "loss_falls": losses[1] < losses[0],
            "replicas_identical": all(torch.equal(mine, theirs) for mine, theirs in zip(shards[comm.rank], replica))}


def group_sizes_and_refusals(comm: Communicator) -> dict:
    """Shard group sizes by default (the node: this machine), from the environment, and what is refused."""
    by_node = ShardGroups(comm, ShardingStrategy.HYBRID_SHARD).shard.world_size
    os.environ[HYBRID_GROUP_SIZE.name] = "2"
    from_environment = ShardGroups(comm, ShardingStrategy.HYBRID_SHARD).shard.world_size
    del os.environ[HYBRID_GROUP_SIZE.name]
    refused = {}
    for name, arguments in {"not_dividing": (ShardingStrategy.HYBRID_SHARD, 3),
                            "not_hybrid": (ShardingStrategy.FULL_SHARD, 2)}.items():
        try:
            ShardGroups(comm, *arguments)
            refused[name] = None
        except ValueError as error:
            refused[name] = str(error)
    return {"by_node": by_node, "from_environment": from_environment, "refused": refused}


if __name__ == "__main__":
    comm = Communicator()
    results = {}
    for name, wrap in STRATEGIES.items():
        for model_kind, optimizer_kind, accumulation, dtype in (("gpt2", "adamw", "none", None),
                                                                ("mlp", "sgd", "no_sync", None),
                                                                ("gpt2", "adamw", "sharded", torch.bfloat16)):
            key = f"{name}/{model_kind}/{optimizer_kind}/{accumulation}" + ("/bf16" if dtype else "")
            results[key] = check_run(key, run(model_kind, optimizer_kind, accumulation, comm, dtype, **wrap), comm)
        overlapped = dict(wrap, forward_prefetch=True, backward_prefetch=True, async_reduce_scatter=True)
        results[f"{name}/gpt2/adamw/none/overlapped"] = check_run(
            f"{name}/gpt2/adamw/none/overlapped", run("gpt2", "adamw", "none", comm, None, **overlapped), comm)
    memory = {name: comm.all_gather_object(kept_bytes(comm, **wrap)) for name, wrap in
              {**STRATEGIES, "full_shard": {}}.items()}
    checkpoint = comm.all_gather_object(checkpoint_loads_under_full_shard(comm, sys.argv[2]))
    hybrid_int8 = comm.all_gather_object(compressed_hybrid(comm))
    groups = group_sizes_and_refusals(comm)
    if comm.rank == 0:
        write_json(output_path(), {"equivalence": results, "memory": memory, "checkpoint_loads": checkpoint,
                                   "groups": groups, "compressed_hybrid": hybrid_int8})

"""Trains the same tied GPT-2 under several ways of running the same algorithm.

Each variant must give bit-identical parameters to plain FULL_SHARD through the
node transport (the default on one machine): MPI reading the buffers directly
(staged where MPI cannot read device memory), forced host staging, MPI messages
split into chunks, the node transport in small exchanges, SHARD_GRAD_OP,
activation checkpointing inside each block, and prefetching with asynchronous
reduce-scatter, through the node and staged (the staged collectives then run on
the communication thread). With ``--device cuda`` the model trains on the GPU
(ranks may share one), in chunks and exchanges a GPU moves in reasonable time.
"""

import copy

import torch
from common import gpt_batch, local_part, output_path, take_device_argument, write_json

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config


def train(model, comm: Communicator, device: torch.device, strategy=ShardingStrategy.FULL_SHARD,
          **overlap) -> dict:
    sharded = FullyShardedDataParallel(
        model.to(device), comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), sharding_strategy=strategy,
        **overlap)
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    for step in range(3):
        inputs, targets = (local_part(t, comm.rank, comm.world_size).to(device)
                           for t in gpt_batch(step, model.config.vocab_size))
        _, loss = sharded(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return sharded.state_dict()


def with_checkpointing(model: GPT2LMHeadModel) -> GPT2LMHeadModel:
    for block in model.transformer.h:
        block.gradient_checkpointing = True
    return model


if __name__ == "__main__":
    device = take_device_argument()
    torch.manual_seed(0)
    initial = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    comm = Communicator()
    # A block (about 50,000 elements, some 17,000 a rank) in 97-element messages and 1,000-byte exchanges on the
    # CPU, hundreds per collective, their edges nowhere near a parameter's or a shard's; on a GPU, where each
    # piece costs a copy and a synchronisation, in a dozen or so.
    on_gpu = device.type == "cuda"
    chunked = Communicator(node_transport=False)
    chunked.max_elements_per_message = 4099 if on_gpu else 97  # bounds the staged chunks too
    small_exchanges = Communicator()
    small_exchanges.node_exchange_bytes = 16384 if on_gpu else 1000
    runs = {
        "through_mpi": train(copy.deepcopy(initial), Communicator(node_transport=False), device),
        "staged": train(copy.deepcopy(initial), Communicator(force_staging=True), device),
        "chunked": train(copy.deepcopy(initial), chunked, device),
        "small_exchanges": train(copy.deepcopy(initial), small_exchanges, device),
        "shard_grad_op": train(copy.deepcopy(initial), comm, device, ShardingStrategy.SHARD_GRAD_OP),
        "checkpointed": train(with_checkpointing(copy.deepcopy(initial)), comm, device),
        "overlapped": train(copy.deepcopy(initial), comm, device, forward_prefetch=True, backward_prefetch=True,
                            async_reduce_scatter=True),
        # staged, so prefetches and reductions run on the communication thread beside the main one
        "staged_overlapped": train(copy.deepcopy(initial), Communicator(force_staging=True), device,
                                   forward_prefetch=True, backward_prefetch=True, async_reduce_scatter=True),
    }
    direct = train(copy.deepcopy(initial), comm, device)
    if comm.rank == 0:
        write_json(output_path(), {
            variant: [name for name, value in state.items() if not torch.equal(value, direct[name])]
            for variant, state in runs.items()
        })

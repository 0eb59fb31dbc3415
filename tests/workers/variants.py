"""Trains the same tied GPT-2 under several ways of running the same algorithm.

Each variant must give bit-identical parameters to plain FULL_SHARD through the
node transport (the default on one machine): MPI reading the buffers directly,
forced host staging, MPI messages split into tiny chunks, the node transport in
exchanges of 16 bytes, SHARD_GRAD_OP, activation checkpointing inside each
block, and prefetching with asynchronous reduce-scatter, through the node and
staged (the staged collectives then run on the communication thread).
"""

import copy

import torch
from common import gpt_batch, local_part, output_path, write_json

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config


def train(model, comm: Communicator, strategy=ShardingStrategy.FULL_SHARD, **overlap) -> dict:
    sharded = FullyShardedDataParallel(
        model, comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), sharding_strategy=strategy, **overlap
    )
    optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    for step in range(3):
        inputs, targets = gpt_batch(step, model.config.vocab_size)
        _, loss = sharded(local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank, comm.world_size))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return sharded.state_dict()


def with_checkpointing(model: GPT2LMHeadModel) -> GPT2LMHeadModel:
    for block in model.transformer.h:
        block.gradient_checkpointing = True
    return model


if __name__ == "__main__":
    torch.manual_seed(0)
    initial = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    comm = Communicator()
    chunked = Communicator(node_transport=False)
    chunked.max_elements_per_message = 7
    small_exchanges = Communicator()
    small_exchanges.node_exchange_bytes = 16
    runs = {
        "through_mpi": train(copy.deepcopy(initial), Communicator(node_transport=False)),
        "staged": train(copy.deepcopy(initial), Communicator(force_staging=True)),
        "chunked": train(copy.deepcopy(initial), chunked),
        "small_exchanges": train(copy.deepcopy(initial), small_exchanges),
        "shard_grad_op": train(copy.deepcopy(initial), comm, ShardingStrategy.SHARD_GRAD_OP),
        "checkpointed": train(with_checkpointing(copy.deepcopy(initial)), comm),
        "overlapped": train(copy.deepcopy(initial), comm, forward_prefetch=True, backward_prefetch=True,
                            async_reduce_scatter=True),
        # staged, so prefetches and reductions run on the communication thread beside the main one
        "staged_overlapped": train(copy.deepcopy(initial), Communicator(force_staging=True), forward_prefetch=True,
                                   backward_prefetch=True, async_reduce_scatter=True),
    }
    direct = train(copy.deepcopy(initial), comm)
    if comm.rank == 0:
        write_json(output_path(), {
            variant: [name for name, value in state.items() if not torch.equal(value, direct[name])]
            for variant, state in runs.items()
        })

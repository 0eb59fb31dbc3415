"""Ranks on several hosts (hpc/cluster's nodes): where they are (node groups, HYBRID_SHARD's groups, the GPU
each would take), training equal to one process under each strategy, and the bytes a step sends over each
node's link against the cost model, for FULL_SHARD in two levels (the default) and in one flat ring.

    cluster.sh exec fmnode0 mpiexec -hosts fmnode0:2,fmnode1:2 -launcher ssh -launcher-exec ssh.sh \
        python multinode.py OUT [placement]

`placement` reports only where the ranks are (for a SLURM job). Run by tests/test_cluster.py, which starts
the cluster.
"""

import socket
import sys
from pathlib import Path
from unittest import mock

import torch
from common import cost_model_units, gpt_batch, local_part, output_path, write_json
from equivalence import run

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy
from fsdp_mpi.sharding.strategy import ShardGroups
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
from measuring.bench_worker import bytes_each_node_sends  # noqa: E402
from measuring.costmodel import Layout, Profile, collectives, step_link_bytes  # noqa: E402
from training.startup import pick_device  # noqa: E402
from training.strategies import node_placement  # noqa: E402

# Every flat buffer over 512 KiB, where MPICH moves large buffers as the cost model says (ring
# all-gather, pairwise reduce-scatter); smaller ones take latency-bound algorithms it does not model.
MODEL = gpt2_config("gpt2-tiny", vocab_size=2048, n_embd=128)


def bytes_on_the_links(comm: Communicator, node: Communicator, strategy: ShardingStrategy,
                       two_level: bool = True) -> dict:
    """One training step's bytes sent by each node and the cost model's prediction; `two_level`: a group that
    spans the nodes goes in two levels (fsdp_mpi's default), else in one flat ring."""
    comm = comm if two_level else Communicator(two_level=False)
    torch.manual_seed(0)
    model = FullyShardedDataParallel(GPT2LMHeadModel(MODEL), comm=comm, sharding_strategy=strategy,
                                     auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    inputs, targets = (local_part(t, comm.rank, comm.world_size) for t in gpt_batch(0, MODEL.vocab_size, seq=32))

    def step():
        _, loss = model(inputs, targets)
        loss.backward()

    step()  # a first step: connections between ranks are made on first use
    sent = bytes_each_node_sends(step, comm, first_on_node=node.rank == 0)
    units = cost_model_units(model)
    layout = Layout(strategy.name, nodes=comm.world_size // node.world_size, ranks_per_node=node.world_size,
                    two_level=two_level)
    profile = Profile(units, optimizer_s=0.0, activation_bytes=0, tokens_per_rank=0)
    return {"measured": sent,
            "predicted": step_link_bytes(profile, layout),
            "collectives": len(collectives(profile, layout))}


def placement(comm: Communicator, node: Communicator) -> dict:
    """Each rank's host and node size, its HYBRID_SHARD shard group's hosts (no group size given), and the GPU
    the GPU scripts would give it on nodes of 2 GPUs (a stand-in for the device count)."""
    hybrid_group = ShardGroups(comm, ShardingStrategy.HYBRID_SHARD).shard
    with mock.patch("torch.cuda.is_available", return_value=True), mock.patch("torch.cuda.device_count",
                                                                                return_value=2):
        device = str(pick_device("cuda", node_placement(comm)[0]))
    return {"hosts": comm.all_gather_object(socket.gethostname()),
            "node_sizes": comm.all_gather_object(node.world_size),
            "hybrid_groups": comm.all_gather_object(sorted(hybrid_group.all_gather_object(socket.gethostname()))),
            "devices": comm.all_gather_object(device)}


if __name__ == "__main__":
    comm = Communicator()
    node = comm.split(None)
    results = placement(comm, node)
    if sys.argv[2:] != ["placement"]:
        results["equivalence"] = {name: run("gpt2", "adamw", "none", comm, None,
                                            sharding_strategy=ShardingStrategy[name])
                                  for name in ("FULL_SHARD", "HYBRID_SHARD", "NO_SHARD")}
        results["link_bytes"] = {name: bytes_on_the_links(comm, node, ShardingStrategy[name])
                                 for name in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")}
        results["link_bytes"]["FULL_SHARD, one flat ring"] = bytes_on_the_links(comm, node, ShardingStrategy.FULL_SHARD,
                                                                                 two_level=False)
    write_json(output_path(), results)

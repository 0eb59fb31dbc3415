"""Each switch observed doing what it says, not only changing nothing (run on 3 ranks).

- SHARD_GRAD_OP keeps every unit gathered from its forward until its backward; FULL_SHARD only the root.
- backward_prefetch starts the all-gather of the unit whose backward comes next.
- async_reduce_scatter leaves a unit's reduction running while backward goes on, one at most.
- activation checkpointing runs each block's layers again in backward.
- forced staging sends every collective through host buffers; chunking splits large messages.

With the argument ``cold`` (ranks started cold, test_switches.py), only the eager steps, and which compilers
they loaded: none.
"""

import sys

import torch
from common import gpt_batch, local_part, output_path, write_json

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy
from fsdp_mpi.communication.transports.direct import MpiCalls
from fsdp_mpi.sharding.flat_gradient import FlatGradient
from fsdp_mpi.sharding.flat_param import FlatParamHandle
from fsdp_mpi.sharding.lifecycle import units_with_names
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config


def build(comm, strategy=ShardingStrategy.FULL_SHARD, checkpointing=False, **overlap):
    torch.manual_seed(0)
    config = gpt2_config("gpt2-tiny", gradient_checkpointing=checkpointing)
    return FullyShardedDataParallel(GPT2LMHeadModel(config), comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
                                    sharding_strategy=strategy, **overlap)


def step(model, comm, batch_index=0):
    inputs, targets = gpt_batch(batch_index, 128)
    _, loss = model(local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank, comm.world_size))
    return loss


def gathered(model) -> list[bool]:
    return [any(h.is_unsharded for h in unit.handles) for _, unit in units_with_names(model)]


class Counting:
    """Counts calls of a method of `cls` (and runs `probe` after each), for the duration of a block."""

    def __init__(self, method: str, probe=None, cls=FlatParamHandle):
        self.cls, self.method, self.probe, self.calls, self.seen = cls, method, probe, 0, []

    def __enter__(self):
        original = self.original = getattr(self.cls, self.method)

        def counted(handle, *args, **kwargs):
            self.calls += 1
            result = original(handle, *args, **kwargs)
            if self.probe is not None:
                self.seen.append(self.probe())
            return result

        setattr(self.cls, self.method, counted)
        return self

    def __exit__(self, *exc):
        setattr(self.cls, self.method, self.original)


def eager_steps(comm: Communicator) -> dict:
    """The switches of plain eager steps: which units stay gathered, prefetching, asynchronous reductions."""
    report = {}
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP):
        model = build(comm, strategy)
        loss = step(model, comm)
        report[f"{strategy.value}_gathered_after_forward"] = gathered(model)
        loss.backward()
        report[f"{strategy.value}_gathered_after_backward"] = gathered(model)

    # backward_prefetch: the order is recorded in the first step; in the second, gathers start early.
    for prefetch in (False, True):
        model = build(comm, backward_prefetch=prefetch)
        step(model, comm).backward()
        loss = step(model, comm, 1)
        with Counting("start_unshard") as started:
            loss.backward()
        report[f"backward_prefetch_{prefetch}_started_gathers"] = started.calls

    # async_reduce_scatter: once a reduction is started, how many are running?
    for asynchronous in (False, True):
        model = build(comm, async_reduce_scatter=asynchronous)
        handles = [h for _, unit in units_with_names(model) for h in unit.handles]

        def running() -> int:
            return sum(h.gradient.in_flight for h in handles)

        loss = step(model, comm)
        with Counting("reduce", probe=running, cls=FlatGradient) as reductions:
            loss.backward()
        report[f"async_{asynchronous}_running_at_each_reduction"] = reductions.seen
        report[f"async_{asynchronous}_running_after_backward"] = running()
    return report


def main(comm: Communicator) -> dict:
    report = eager_steps(comm)
    # Activation checkpointing: each block's attention runs once in forward, once more in backward, where the
    # re-run finds its unit gathered for backward: no collective more than without checkpointing.
    for checkpointing in (False, True):
        model = build(comm, checkpointing=checkpointing)
        calls = []
        for block in model.transformer.h:
            block.attn.register_forward_hook(lambda *_: calls.append(1))
        collectives_before = comm.collectives_started
        step(model, comm).backward()
        report[f"checkpointing_{checkpointing}_attention_calls"] = len(calls)
        report[f"checkpointing_{checkpointing}_collectives"] = comm.collectives_started - collectives_before

    # Forced staging copies through host buffers; a message limit of 7 elements splits every gather.
    for name, communicator in (("staged", Communicator(force_staging=True)), ("chunked", Communicator(node_transport=False))):
        if name == "chunked":
            communicator.max_elements_per_message = 7
        model = build(communicator)
        with torch.no_grad(), Counting("all_gather", cls=MpiCalls) as gathers:  # MPI's own, message by message
            step(model, communicator)
        report[f"{name}_all_gather_calls_in_forward"] = gathers.calls
        report[f"{name}_staging_slots"] = communicator.staging_slots
    report["shard_numels"] = [h.shard_numel for _, unit in units_with_names(build(comm)) for h in unit.handles]
    return report


def compilers_loaded_by_eager_steps(comm: Communicator) -> dict:
    """Plain eager steps load no compiler (torch's checkpoint, in `main`, does): in a rank started cold."""
    eager_steps(comm)
    return {"compiler_loaded": [name for name in ("torch._dynamo", "torch._inductor") if name in sys.modules]}


if __name__ == "__main__":
    communicator = Communicator()
    cold = sys.argv[2:] == ["cold"]
    write_json(output_path(), compilers_loaded_by_eager_steps(communicator) if cold else main(communicator))

"""Trains under FSDP on every rank and, on each rank, a plain copy on the whole global batch.

Writes per-step loss differences and per-tensor parameter differences for
{NestedMLP, tied GPT-2} x {SGD with momentum, AdamW}.
"""

import copy

import torch
from common import NestedMLP, ResidualBlock, gpt_batch, local_part, relative_differences, mlp_batch, output_path, write_json

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy
from models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config

STEPS = 4


def make_optimizer(kind: str, params, weight_decay: float):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=2e-3, weight_decay=weight_decay)


def run(model_kind: str, optimizer_kind: str, comm: Communicator) -> dict:
    torch.manual_seed(0)
    if model_kind == "mlp":
        reference = NestedMLP()
        policy, batch_fn, weight_decay = ModuleWrapPolicy({ResidualBlock}), mlp_batch, 0.0
    else:
        config = gpt2_config("gpt2-tiny")
        reference = GPT2LMHeadModel(config)
        policy, weight_decay = ModuleWrapPolicy({GPT2Block}), 0.1
        batch_fn = lambda step: gpt_batch(step, config.vocab_size)  # noqa: E731
    sharded = FullyShardedDataParallel(copy.deepcopy(reference), comm=comm, auto_wrap_policy=policy)
    optimizer = make_optimizer(optimizer_kind, sharded.parameters(), weight_decay)
    reference_optimizer = make_optimizer(optimizer_kind, reference.parameters(), weight_decay)

    loss_differences = []
    for step in range(STEPS):
        inputs, targets = batch_fn(step)
        _, local_loss = sharded(local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank, comm.world_size))
        local_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sharded_loss = comm.allreduce_sum_float(local_loss.item()) / comm.world_size

        _, reference_loss = reference(inputs, targets)
        reference_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        loss_differences.append(abs(sharded_loss - reference_loss.item()))

    state = sharded.state_dict()
    result = {"loss_differences": loss_differences}
    if comm.rank == 0:
        assert set(state) == set(reference.state_dict()), "state dict keys differ from the plain model's"
        result["param_differences"] = relative_differences(state, reference.state_dict())
    return result


if __name__ == "__main__":
    comm = Communicator()
    results = {f"{m}/{o}": run(m, o, comm) for m in ("mlp", "gpt2") for o in ("sgd", "adamw")}
    write_json(output_path(), results)

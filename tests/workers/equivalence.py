"""Trains under FSDP on every rank and, on each rank, a plain copy on the whole global batch.

Writes per-step loss differences and per-tensor parameter differences for
{NestedMLP, tied GPT-2, BERT pre-training} x {SGD with momentum, AdamW}.
"""

import copy

import torch
from common import (NestedMLP, ResidualBlock, bert_batch, gpt_batch, local_part, mlp_batch, output_path,
                    relative_differences, write_json)

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy
from models.bert import BertForPreTraining, BertLayer, bert_config
from models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config

STEPS = 4


ADAMW_LR = 2e-3
# A parameter whose gradient is mathematically zero (an attention key bias) holds only
# rounding noise; Adam turns noise into steps of up to lr, so such tensors are compared
# at the scale Adam could move them in the whole run, SGD's at a small fixed scale.
NEARLY_ZERO_RMS = {"sgd": 1e-3, "adamw": ADAMW_LR * STEPS}


def make_optimizer(kind: str, params, weight_decay: float):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=ADAMW_LR, weight_decay=weight_decay)


def run(model_kind: str, optimizer_kind: str, comm: Communicator) -> dict:
    torch.manual_seed(0)
    if model_kind == "mlp":
        reference = NestedMLP()
        policy, batch_fn, weight_decay = ModuleWrapPolicy({ResidualBlock}), mlp_batch, 0.0
    elif model_kind == "gpt2":
        config = gpt2_config("gpt2-tiny")
        reference = GPT2LMHeadModel(config)
        policy, weight_decay = ModuleWrapPolicy({GPT2Block}), 0.1
        batch_fn = lambda step: gpt_batch(step, config.vocab_size)  # noqa: E731
    else:
        config = bert_config("bert-tiny", vocab_size=100, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        reference = BertForPreTraining(config)
        policy, weight_decay = ModuleWrapPolicy({BertLayer}), 0.1
        batch_fn = lambda step: bert_batch(step, config.vocab_size)  # noqa: E731
    sharded = FullyShardedDataParallel(copy.deepcopy(reference), comm=comm, auto_wrap_policy=policy)
    optimizer = make_optimizer(optimizer_kind, sharded.parameters(), weight_decay)
    reference_optimizer = make_optimizer(optimizer_kind, reference.parameters(), weight_decay)

    loss_differences = []
    for step in range(STEPS):
        batch = batch_fn(step)
        local_loss = sharded(*(local_part(t, comm.rank, comm.world_size) for t in batch))[-1]
        local_loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        sharded_loss = comm.allreduce_sum_float(local_loss.item()) / comm.world_size

        reference_loss = reference(*batch)[-1]
        reference_loss.backward()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
        loss_differences.append(abs(sharded_loss - reference_loss.item()))

    state = sharded.state_dict()
    result = {"loss_differences": loss_differences}
    if comm.rank == 0:
        assert set(state) == set(reference.state_dict()), "state dict keys differ from the plain model's"
        result["param_differences"] = relative_differences(
            state, reference.state_dict(), NEARLY_ZERO_RMS[optimizer_kind])
    return result


if __name__ == "__main__":
    comm = Communicator()
    results = {f"{m}/{o}": run(m, o, comm) for m in ("mlp", "gpt2", "bert") for o in ("sgd", "adamw")}
    write_json(output_path(), results)

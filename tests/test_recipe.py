"""The experiments' shared training recipe: which parameters decay, the learning-rate schedule, and how
accumulated micro-batches split a batch across ranks."""

from types import SimpleNamespace

import pytest
from torch import nn

from fsdp_mpi import FullyShardedDataParallel, ModuleWrapPolicy
from fsdp_mpi_models.bert import BertForPreTraining, BertLayer, bert_config
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config
from training.recipe import FUSED_ON_CPU, optimizer_and_schedule, parameter_groups
from training.sampling import Batching, epoch_steps, total_optimizer_steps


def decay_groups_by_name(model: nn.Module) -> tuple[list[str], list[str]]:
    """The names in the recipe's (decayed, undecayed) groups; a parameter listed twice appears twice."""
    names = {id(param): name for name, param in model.named_parameters()}
    decay, no_decay = parameter_groups(model, weight_decay=0.1)
    assert (decay["weight_decay"], no_decay["weight_decay"]) == (0.1, 0.0)
    return [names[id(p)] for p in decay["params"]], [names[id(p)] for p in no_decay["params"]]


def shard_on_one_rank(model: nn.Module, block_class: type) -> nn.Module:
    """fsdp-mpi on a world of one: the optimizer sees only 1-D views, so shapes cannot tell weights from biases."""
    sharded = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({block_class}))
    assert all(param.dim() == 1 for param in sharded.parameters())
    return sharded


@pytest.mark.one_rank
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fsdp-mpi"])
def test_gpt2_decays_weights_and_embeddings_not_biases_or_layer_norms(sharded):
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))  # 2 blocks; lm_head.weight is transformer.wte.weight
    count = sum(p.numel() for p in model.parameters())  # each once, the vocabulary's padding rows included
    if sharded:
        model = shard_on_one_rank(model, GPT2Block)
    decay, no_decay = decay_groups_by_name(model)
    blocks = [f"transformer.h.{i}." for i in range(2)]
    assert sorted(decay) == sorted(["transformer.wte.weight", "transformer.wpe.weight"] + [
        block + name for block in blocks
        for name in ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")])
    assert sorted(no_decay) == sorted(["transformer.ln_f.weight", "transformer.ln_f.bias"] + [
        block + name for block in blocks
        for name in ("ln_1.weight", "ln_1.bias", "attn.c_attn.bias", "attn.c_proj.bias", "ln_2.weight", "ln_2.bias",
                     "mlp.c_fc.bias", "mlp.c_proj.bias")])
    assert sum(p.numel() for group in parameter_groups(model, 0.1) for p in group["params"]) == count


@pytest.mark.one_rank
@pytest.mark.parametrize("sharded", [False, True], ids=["plain", "fsdp-mpi"])
def test_bert_decays_weights_and_embeddings_not_biases_or_layer_norms(sharded):
    model = BertForPreTraining(bert_config("bert-tiny"))  # 2 layers; the decoder is tied to the word embeddings
    count = sum(p.numel() for p in model.parameters())  # each once, the vocabulary's padding rows included
    if sharded:
        model = shard_on_one_rank(model, BertLayer)
    decay, no_decay = decay_groups_by_name(model)
    # Hugging Face's rule by name: no decay for biases and LayerNorm parameters. 3 embeddings, 6 matrices per
    # layer, pooler, head transform and NSP; 2 + 10 per layer + pooler bias, MLM bias, head transform's 3, NSP bias.
    assert len(decay) == 3 + 2 * 6 + 3 and len(no_decay) == 2 + 2 * 10 + 1 + 1 + 3 + 1
    assert all(name.endswith(".weight") and "LayerNorm" not in name for name in decay)
    assert all(name.endswith(".bias") or ".LayerNorm." in name for name in no_decay)
    assert "bert.embeddings.word_embeddings.weight" in decay and "cls.predictions.bias" in no_decay
    assert sum(p.numel() for group in parameter_groups(model, 0.1) for p in group["params"]) == count


@pytest.mark.parametrize("warmup_steps", [10, None], ids=["given", "default"])
def test_schedule_warms_up_linearly_then_follows_a_cosine_to_a_tenth(warmup_steps):
    # 101 steps: the default warm-up is int(101 / 10) = 10 steps too, and the cosine spans steps 10 to 100.
    optimizer, schedule = optimizer_and_schedule(nn.Linear(3, 2), total_steps=101, lr=2e-3, weight_decay=0.1,
                                                 warmup_steps=warmup_steps)
    assert optimizer.defaults["fused"] == FUSED_ON_CPU  # fused on the CPU where torch has it (2.4 on), as on a GPU
    lrs = []
    for _ in range(101):
        assert optimizer.param_groups[0]["lr"] == optimizer.param_groups[1]["lr"]
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert lrs[0] == pytest.approx(2e-3 / 10)  # the first of 10 warm-up steps
    assert lrs[9] == pytest.approx(2e-3) and lrs[10] == pytest.approx(2e-3)  # the warm-up's end, the cosine's start
    assert lrs[55] == pytest.approx(2e-3 * 0.55)  # half-way down the cosine: (1 + 0.1) / 2
    assert lrs[100] == pytest.approx(2e-3 * 0.1)
    assert all(a < b for a, b in zip(lrs[:10], lrs[1:10])) and all(a > b for a, b in zip(lrs[10:], lrs[11:]))


@pytest.mark.parametrize("num_samples", [19, 17])  # the last step short; one rank with nothing left for it
def test_accumulated_micro_batches_hold_the_samples_and_weights_of_one_batch(num_samples):
    world = 2

    def steps(rank, batch_size, grad_accum, steps_per_epoch=0):
        batching = Batching(batch_size, grad_accum, steps_per_epoch)
        return epoch_steps(num_samples, batching, SimpleNamespace(rank=rank, world_size=world), 1, 3)

    per_rank = [steps(rank, batch_size=2, grad_accum=2) for rank in range(world)]
    assert [len(micro_batches) for micro_batches in per_rank[0]] == [2, 2, 1]  # 5 micro-batches of up to 2
    for rank, accumulated in enumerate(per_rank):
        whole = steps(rank, batch_size=4, grad_accum=1)
        assert len(accumulated) == len(whole) == 3
        for micro_batches, (batch,) in zip(accumulated, whole):
            used = [micro for micro in micro_batches if micro.weight]
            expected = batch.indices.tolist() if batch.weight else []
            assert [i for micro in used for i in micro.indices.tolist()] == expected
            assert {micro.weight for micro in used} <= {batch.weight}
            assert sum(micro.samples for micro in micro_batches) == batch.samples
    # Averaged over ranks, every step's weights sum to 1: the mean over that step's samples.
    for step in zip(*per_rank):
        assert sum(m.weight * len(m.indices) for micro_batches in step for m in micro_batches) == pytest.approx(world)
    assert sum(m.samples for micro_batches in per_rank[0] for m in micro_batches) == num_samples
    assert len(steps(0, batch_size=2, grad_accum=2, steps_per_epoch=2)) == 2  # --steps-per-epoch counts optimizer steps
    assert total_optimizer_steps(num_samples, Batching(2, grad_accum=2, steps_per_epoch=0), 4, world) == 4 * 3
    assert total_optimizer_steps(num_samples, Batching(2, grad_accum=2, steps_per_epoch=2), 4, world) == 4 * 2

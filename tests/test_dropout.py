"""Dropout drawn per sample (fsdp_mpi.use_sample_dropout), in one process: a batch split any way draws the masks
of the whole batch, and what cannot be drawn per sample is refused. That N ranks then train as one process with
dropout on is test_equivalence's (gpt2_dropout, bert_dropout), and that a run resumes on another number of ranks
with dropout on is test_resume_experiments'."""

import math

import pytest
import torch
from torch import nn

from fsdp_mpi import SampleDropout, SampleKeys, use_sample_dropout
from fsdp_mpi_models.attention import attention
from fsdp_mpi_models.gpt2 import GPT2LMHeadModel, gpt2_config


def dropout_layer(p: float = 0.3, name: str = "block.dropout", seed: int = 1) -> SampleDropout:
    return SampleDropout(p, SampleKeys(seed), name)


def masks(layer: SampleDropout, step: int, samples, shape) -> torch.Tensor:
    layer.keys.set_batch(step, torch.tensor(samples))
    return layer(torch.ones(len(samples), *shape)) != 0


def test_a_batch_split_any_way_draws_the_masks_of_the_whole_batch():
    layer = dropout_layer()
    whole = masks(layer, 7, range(12), (5, 16))
    for parts in ([range(0, 6), range(6, 12)], [range(0, 4), range(4, 8), range(8, 12)], [range(0, 1), range(1, 12)]):
        assert torch.equal(torch.cat([masks(layer, 7, list(part), (5, 16)) for part in parts]), whole)
    # a sample padded to another length keeps the masks of the positions it had
    assert torch.equal(masks(layer, 7, range(12), (9, 16))[:, :5], whole)


def test_masks_have_the_rate_and_scale_of_torch_dropout_and_change_with_every_key():
    p, shape = 0.3, (64, 128)
    layer = dropout_layer(p)
    layer.keys.set_batch(3, torch.arange(16))
    x = torch.randn(16, *shape)
    y = layer(x)
    kept = y != 0
    n = kept.numel()
    # the kept fraction of n independent draws lies within 6 standard deviations of 1 - p
    assert abs(kept.float().mean().item() - (1 - p)) <= 6 * math.sqrt(p * (1 - p) / n)
    assert torch.equal(y[kept], x[kept] * (1 / (1 - p)))
    # neighbours (the next sample, the next position) are drawn independently: correlation near 0
    for a, b in ((kept[:-1], kept[1:]), (kept[:, :, :-1], kept[:, :, 1:])):
        assert abs(torch.corrcoef(torch.stack([a.flatten().float(), b.flatten().float()]))[0, 1]) <= 6 / math.sqrt(a.numel())
    different = {"step": masks(layer, 4, range(16), shape), "seed": masks(dropout_layer(p, seed=2), 3, range(16), shape),
                 "layer": masks(dropout_layer(p, name="block.other"), 3, range(16), shape)}
    for key, mask in different.items():
        # two independent masks agree on p^2 + (1-p)^2 of their elements: far below all
        assert (mask == kept).float().mean().item() < 1 - p * (1 - p), key
    layer.eval()
    assert layer(x) is x


def test_every_dropout_of_our_gpt2_is_replaced_and_named_by_its_path():
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", n_layer=2))
    use_sample_dropout(model, seed=0)
    names = [module.name for module in model.modules() if isinstance(module, SampleDropout)]
    assert names == ["transformer.drop"] + [f"transformer.h.{i}.{part}" for i in range(2)
                                            for part in ("attn.attn_dropout", "attn.resid_dropout", "mlp.dropout")]
    assert not any(type(module) is nn.Dropout for module in model.modules())
    with pytest.raises(ValueError, match="already draws dropout per sample"):
        use_sample_dropout(model, seed=1)  # the new keys would drive nothing


def test_gradient_checkpointing_recomputes_the_same_masks():
    gradients = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(gpt2_config("gpt2-tiny", dropout=0.2, gradient_checkpointing=checkpointing))
        keys = use_sample_dropout(model, seed=0)
        keys.set_batch(0, torch.arange(4))
        tokens = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1))
        model(tokens, tokens)[1].backward()
        gradients.append([p.grad for p in model.parameters()])
    for plain, recomputed in zip(*gradients):
        torch.testing.assert_close(recomputed, plain, rtol=0, atol=0)


class Identity(nn.Dropout):
    """A dropout module that is not torch's own (so attention computes the probabilities itself) and keeps all."""

    def forward(self, x):
        return x


@pytest.mark.parametrize("causal", [False, True])
def test_attention_computed_for_a_dropout_module_equals_the_fused_kernel(causal):
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 8, 4, generator=generator, dtype=torch.float64) for _ in range(3))
    attend = None if causal else torch.rand(2, 1, 1, 8, generator=generator) > 0.3
    if attend is not None:
        attend[..., 0] = True  # every query sees at least one key
    ours = attention(q, k, v, Identity(0.5), causal=causal, attend=attend)
    fused = attention(q, k, v, nn.Dropout(0.5).eval(), causal=causal, attend=attend)
    torch.testing.assert_close(ours, fused, rtol=1e-12, atol=1e-12)


def test_what_cannot_be_drawn_per_sample_is_refused_by_name():
    layer = dropout_layer()
    with pytest.raises(RuntimeError, match="block.dropout.*no samples set; call set_batch"):
        layer(torch.ones(2, 3))
    layer.keys.set_batch(0, torch.arange(4))
    with pytest.raises(ValueError, match=r"input \(2, 3\) must be batch-first with one row per sample.*\(4\)"):
        layer(torch.ones(2, 3))
    model = nn.Sequential(nn.Dropout2d(0.1), nn.MultiheadAttention(8, 2, dropout=0.1), nn.Dropout(0.1))
    with pytest.raises(ValueError, match=r"0 \(Dropout2d\), 1 \(MultiheadAttention\)"):
        use_sample_dropout(model, seed=0)
    assert type(model[2]) is nn.Dropout  # refused before anything was replaced


def test_an_impossible_dropout_option_is_a_usage_error():
    from training.options import RunConfig, UsageError, argument_parser, check_config
    parser = argument_parser("test", ["gpt2-tiny"], {"model": "gpt2-tiny", "epochs": 1, "steps_per_epoch": 0,
                                                     "batch_size": 1, "seq_len": 8, "lr": 1e-3})
    for value in ("1", "-0.1"):
        with pytest.raises(UsageError, match="--dropout must be at least 0 and below 1"):
            check_config(RunConfig.from_namespace(parser.parse_args(["--dropout", value])))


def test_a_layer_key_never_meets_a_tensor_as_an_integer_past_int64():
    """A layer's key (its name's crc32, up to 2^32) spread by the golden ratio passes 2^63 as a Python int for about
    one name in five; older torch refuses to add such an int to an int64 tensor, as numpy does. Hashed into a numpy
    int64 array (as strict as older torch), every key gives what Python's unbounded ints give."""
    import numpy

    from fsdp_mpi.loop.sample_dropout import _LOW32, _combine

    for layer in (0, 1, 0x7FFFFFFF, 0xDEADBEEF, 0xFFFFFFFF):
        expected = [_combine(key, layer) for key in (0, 12345, _LOW32)]
        assert _combine(numpy.array([0, 12345, _LOW32], dtype=numpy.int64), layer).tolist() == expected

"""Full state dicts carry the original names and values; loading one back sets every shard."""

import copy
import json

import pytest
import torch
from mpi_launch import check_ok, run_mpi

from fsdp_mpi import FullyShardedDataParallel, ModuleWrapPolicy, summon_full_params
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config


def plain_and_wrapped():
    """A gpt2-tiny and its wrapped copy on one rank (call it inside a `one_rank` test: it needs MPI)."""
    torch.manual_seed(0)
    plain = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    wrapped = FullyShardedDataParallel(copy.deepcopy(plain), auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    return plain, wrapped


@pytest.mark.one_rank
def test_state_dict_arguments_are_torchs_or_refused_with_the_reason():
    plain, wrapped = plain_and_wrapped()
    names = list(wrapped.state_dict())
    into = {}
    assert wrapped.state_dict(into, "model.") is into and list(into) == [f"model.{name}" for name in names]
    assert list(wrapped.state_dict(prefix="p.")) == [f"p.{name}" for name in names]
    with pytest.raises(ValueError, match="keep_vars=True.*gathered copies"):
        wrapped.state_dict(keep_vars=True)
    with pytest.raises(TypeError, match="at most 2 positional"):
        wrapped.state_dict({}, "", True)
    with pytest.raises(ValueError, match="assign=True.*views of its flat shards"):
        wrapped.load_state_dict(plain.state_dict(), assign=True)


@pytest.mark.one_rank
def test_state_dict_has_original_names_and_values():
    plain, wrapped = plain_and_wrapped()
    expected = plain.state_dict()
    state = wrapped.state_dict()
    assert set(state) == set(expected)
    for name, value in expected.items():
        assert torch.equal(state[name], value), name
    assert state["lm_head.weight"] is state["transformer.wte.weight"]  # still tied


@pytest.mark.one_rank
def test_saved_state_loads_into_a_plain_model():
    plain, wrapped = plain_and_wrapped()
    fresh = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    fresh.load_state_dict(wrapped.state_dict())
    tokens = torch.randint(0, 128, (2, 8))
    assert torch.equal(fresh(tokens)[0], plain(tokens)[0])


@pytest.mark.one_rank
def test_load_state_dict_round_trip():
    plain, wrapped = plain_and_wrapped()
    other = GPT2LMHeadModel(gpt2_config("gpt2-tiny")).state_dict()
    result = wrapped.load_state_dict(other)
    assert result.missing_keys == [] and result.unexpected_keys == []
    tokens = torch.randint(0, 128, (2, 8))
    reference = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    reference.load_state_dict(other)
    assert torch.equal(wrapped(tokens)[0], reference(tokens)[0])


@pytest.mark.one_rank
def test_load_state_dict_names_bad_entries_and_changes_nothing():
    _, wrapped = plain_and_wrapped()
    before = wrapped.state_dict()
    bad = dict(before)
    bad["transformer.ln_f.weight"] = torch.zeros(5)
    del bad["transformer.h.0.attn.c_attn.bias"]
    bad["extra.weight"] = torch.zeros(1)
    with pytest.raises(RuntimeError) as error:
        wrapped.load_state_dict(bad)
    message = str(error.value)
    assert "missing keys: transformer.h.0.attn.c_attn.bias" in message
    assert "unexpected keys: extra.weight" in message
    assert "transformer.ln_f.weight: checkpoint (5,), model (64,)" in message
    after = wrapped.state_dict()
    assert all(torch.equal(after[name], before[name]) for name in before)


@pytest.mark.one_rank
def test_summon_full_params_exposes_and_writes_back():
    plain, wrapped = plain_and_wrapped()
    with summon_full_params(wrapped):
        ln_f = wrapped.module.transformer.ln_f
        assert torch.equal(ln_f.weight, plain.transformer.ln_f.weight)
        ln_f.weight.fill_(2.0)
    assert torch.equal(wrapped.state_dict()["transformer.ln_f.weight"], torch.full((64,), 2.0))
    assert not any(h.gathered_bytes for m in wrapped.modules() if isinstance(m, FullyShardedDataParallel) for h in m.handles)


@pytest.mark.parametrize("nprocs", [1, 3])
def test_state_dicts_summon_and_wrap_time_broadcast_across_ranks(nprocs, tmp_path):
    """3 ranks: shards with offsets and padding; 1 rank: the gathered buffer is the shard itself."""
    out = tmp_path / "state_dicts.json"
    check_ok(run_mpi("state_dicts.py", nprocs, out))
    report = json.loads(out.read_text())
    # A forward abandoned before a full step: the step's gradients are one process's, within equivalence's bound.
    gradients = report.pop("abandoned_forward_then_step_gradients")
    assert gradients["grad_error"] <= gradients["grad_bound"] and gradients["worst_tensor_ratio"] <= 1, gradients
    expected = {
        "broadcast_rank0_weights": True, "rank0_only_empty_elsewhere": True,
        "load_round_trip": True, "loaded_model_computes_like_source": True,
        "bad_dict_raised": True, "bad_dict_changed_nothing": True,
        "summon_shows_full_shape": True,
        "summon_writeback_True_kept_edit": True, "summon_writeback_True_others_same": True,
        "summon_writeback_False_kept_edit": False, "summon_writeback_False_others_same": True,
        "nothing_gathered_after_summon": True,
        "abandoned_forward_cleared": True, "abandoned_forward_then_step_has_gradients": True,
        "ignored_unit_gets_no_gradient": True, "ignored_unit_resharded": True,
        "size_policy_units": ["", "transformer.h.0", "transformer.h.1"], "size_policy_state_same": True,
    }
    if nprocs > 1:
        expected |= {"subcommunicator_shards": True, "subcommunicator_state_same": True}
    assert report == expected

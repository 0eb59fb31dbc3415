"""State dicts, summon_full_params and wrap-time broadcast where shards have offsets and padding.

Run on 3 ranks (and on 1, where the gathered buffer is the shard itself). Every
rank seeds differently before building its model, so only the broadcast of rank
0's weights makes them agree. Writes booleans (and a few counts) for the test.
"""

import copy

import torch
from common import gpt_batch, local_part, output_path, same_state, write_json
from gradients import compare_gradients, full_gradients, reference_gradients

from fsdp_mpi import (Communicator, FullyShardedDataParallel, ModuleWrapPolicy, SizeBasedWrapPolicy,
                      full_state_dict, summon_full_params)
from fsdp_mpi.sharding.lifecycle import units_with_names
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config


def gpt2(seed: int) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    return GPT2LMHeadModel(gpt2_config("gpt2-tiny"))


def wrap(model, comm, policy=None):
    return FullyShardedDataParallel(model, comm=comm, auto_wrap_policy=policy or ModuleWrapPolicy({GPT2Block}))


def parameter_spanning_shards(model) -> tuple[str, tuple]:
    """The original name and shape of a parameter whose elements lie on more than one rank."""
    for prefix, unit in units_with_names(model):
        for handle in unit.handles:
            for slot in handle.slots:
                first, last = slot.offset // handle.shard_numel, (slot.offset + slot.numel - 1) // handle.shard_numel
                if last > first:
                    return (f"{prefix}.{slot.uses[0].name}" if prefix else slot.uses[0].name), tuple(slot.shape)
    raise AssertionError("no parameter spans two shards")


def gathered_anywhere(model) -> bool:
    return any(h.gathered_bytes for _, u in units_with_names(model) for h in u.handles)


def main(comm: Communicator) -> dict:
    report = {}
    rank0_model = gpt2(seed=0)
    model = wrap(gpt2(seed=comm.rank), comm)  # ranks start different
    expected = rank0_model.state_dict()
    everywhere = full_state_dict(model, rank0_only=False)
    report["broadcast_rank0_weights"] = all(comm.all_gather_object(same_state(everywhere, expected)))
    report["rank0_only_empty_elsewhere"] = all(comm.all_gather_object(
        (model.state_dict() == {}) == (comm.rank != 0)))

    # Loading a different model's weights sets every shard: gathered back, and computing, it is that model.
    other = gpt2(seed=123)
    model.load_state_dict(other.state_dict())
    tokens = gpt_batch(0, 128)[0][:2]
    report["load_round_trip"] = all(comm.all_gather_object(
        same_state(full_state_dict(model, rank0_only=False), other.state_dict())))
    with torch.no_grad():
        report["loaded_model_computes_like_source"] = all(comm.all_gather_object(
            torch.equal(model(tokens)[0], other(tokens)[0])))

    # A bad dict whose good entries hold *different* values must change nothing.
    bad = gpt2(seed=456).state_dict()
    bad["transformer.ln_f.weight"] = torch.zeros(5)
    try:
        model.load_state_dict(bad)
        report["bad_dict_raised"] = False
    except RuntimeError as error:
        report["bad_dict_raised"] = "transformer.ln_f.weight: checkpoint (5,), model (64,)" in str(error)
    report["bad_dict_changed_nothing"] = all(comm.all_gather_object(
        same_state(full_state_dict(model, rank0_only=False), other.state_dict())))

    # summon_full_params on a parameter that spans shards: edits kept with writeback, dropped without.
    name, shape = parameter_spanning_shards(model) if comm.world_size > 1 else ("transformer.h.0.attn.c_attn.weight",
                                                                                 None)
    owner_path, attribute = name.rsplit(".", 1)
    for writeback, value in ((True, 7.0), (False, 9.0)):
        before = full_state_dict(model, rank0_only=False)
        with summon_full_params(model, writeback=writeback):
            full = getattr(model.module.get_submodule(owner_path), attribute)
            report.setdefault("summon_shows_full_shape", True)
            report["summon_shows_full_shape"] &= tuple(full.shape) == tuple(before[name].shape)
            full.fill_(value)
        after = full_state_dict(model, rank0_only=False)
        edited = torch.equal(after[name], torch.full_like(after[name], value))
        # Tied names share one tensor in the state dict; they are the same parameter.
        others_same = all(torch.equal(after[k], before[k]) for k in before if after[k] is not after[name])
        report[f"summon_writeback_{writeback}_kept_edit"] = all(comm.all_gather_object(edited))
        report[f"summon_writeback_{writeback}_others_same"] = all(comm.all_gather_object(others_same))
    report["nothing_gathered_after_summon"] = not gathered_anywhere(model)

    # A forward with no backward, then a normal step: the abandoned state is cleared.
    # Its gradients are those of one process on the global batch (fp32 and fp64), within equivalence's bound.
    plain, plain64 = copy.deepcopy(rank0_model), copy.deepcopy(rank0_model).double()
    fresh = wrap(copy.deepcopy(rank0_model), comm)
    inputs, targets = gpt_batch(1, 128)
    fresh(local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank, comm.world_size))
    fresh(local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank, comm.world_size))[1].backward()
    plain(inputs, targets)[1].backward()
    plain64(inputs, targets)[1].backward()
    report["abandoned_forward_cleared"] = not gathered_anywhere(fresh)
    report["abandoned_forward_then_step_has_gradients"] = all(p.grad is not None and p.grad.numel() == p.numel()
                                                              for p in fresh.parameters())
    gradients = compare_gradients(full_gradients(fresh), reference_gradients(plain, torch.float64),
                                  reference_gradients(plain64, torch.float64), comm.world_size, u=2.0**-24)
    report["abandoned_forward_then_step_gradients"] = gradients

    # A unit that ran forward but whose output the loss ignores gets no gradient (None), as in one process.
    ignored = wrap(copy.deepcopy(rank0_model), comm)
    block = ignored.transformer.h[1]
    x = torch.randn(2, 4, 64)
    _ = block(x)  # runs, output ignored
    ignored.transformer.h[0](x).sum().backward()
    block_grads = [p.grad for p in block.parameters()]
    report["ignored_unit_gets_no_gradient"] = all(comm.all_gather_object(all(g is None for g in block_grads)))
    report["ignored_unit_resharded"] = not gathered_anywhere(ignored)

    # SizeBasedWrapPolicy: each block (49,984 parameters) becomes a unit at a threshold of 40,000.
    sized = wrap(copy.deepcopy(rank0_model), comm, SizeBasedWrapPolicy(min_num_params=40_000))
    report["size_policy_units"] = [name for name, _ in units_with_names(sized)]
    report["size_policy_state_same"] = all(comm.all_gather_object(
        same_state(full_state_dict(sized, rank0_only=False), expected)))

    # Another communicator than COMM_WORLD: ranks split by parity share their own shards.
    if comm.world_size > 1:
        half = Communicator(comm.mpi_comm.Split(color=comm.rank % 2, key=comm.rank))
        split = wrap(copy.deepcopy(rank0_model), half)
        handle = split.handles[0]
        report["subcommunicator_shards"] = all(comm.all_gather_object(
            handle.shard_numel == handle.padded_numel // half.world_size))
        report["subcommunicator_state_same"] = all(comm.all_gather_object(
            same_state(full_state_dict(split, rank0_only=False), expected)))
    return report


if __name__ == "__main__":
    communicator = Communicator()
    write_json(output_path(), main(communicator))

"""A sharded model called the way its users call it, not only through its top (run under mpiexec).

Each case calls one entry point of a wrapped model and of the same model in one
process, in float64 so that sharding's only difference, the order of a sum over
ranks, stays far below the bounds (N ulps of float64, about 1e-15, against 1e-9 of the output's or the
whole gradient's norm):

- a part of the root unit (``transformer.wte``; the whole ``transformer`` stack), without and with autograd;
- a part of a nested unit (``transformer.h[1].mlp``), with autograd;
- Hugging Face's T5, an encoder-decoder with one embedding shared by both, trained one step and
  generating greedily: ``generate()`` calls the encoder alone, then the decoder token by token.
  (T5's layer norm takes its variance in float32 even in a float64 model, so there the bound is
  float32's: 1e-6, 16 ulps.)

For every call: the output, the gradients that reach the shards (averaged over ranks, each rank
on its share of the batch), which units were gathered (the all-gather bytes, against each unit's
padded buffer), and that nothing stays gathered afterwards.
"""

import copy

import torch
from common import local_part, output_path, write_json

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy
from fsdp_mpi.sharding.lifecycle import units_with_names

def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return float((ours - reference).norm() / reference.norm().clamp(min=1e-300))


def gradient_error(sharded, plain) -> float:
    """The worst error of this rank's part of a gradient against one process's, relative to the norm of the
    whole model's gradient (a tensor whose gradient nearly cancels has rounding of the others' size); inf if
    a parameter has a gradient in one and none in the other."""
    references = dict(plain.named_parameters())
    scale = torch.cat([p.grad.reshape(-1) for p in references.values() if p.grad is not None]).norm()
    worst = 0.0
    for (unit_name, unit) in units_with_names(sharded):
        for handle in unit.handles:
            for slot, view in zip(handle.slots, handle.sharded_views):
                reference = references[".".join(filter(None, (unit_name, slot.uses[0].name)))].grad
                if (reference is None) != (view.grad is None):
                    return float("inf")
                start, stop = handle.part_held(slot)
                if reference is not None and stop > start:
                    worst = max(worst, float((view.grad - reference.reshape(-1)[start:stop]).norm() / scale))
    return worst


def gathered_bytes(model) -> dict:
    """Each unit's padded buffer in bytes, and whether any unit holds gathered parameters now."""
    return {name or "<root>": sum(h.padded_numel * h.full_flat.element_size() for h in unit.handles)
            for name, unit in units_with_names(model)}


def still_gathered(model) -> bool:
    return any(h.gathered_bytes for _, unit in units_with_names(model) for h in unit.handles)


def call(comm, sharded, plain, name: str, ours_call, plain_call, backward: bool, expected_units: dict) -> dict:
    """One entry point: output and gradient errors, all-gather bytes against the units expected (unit: times)."""
    sharded.zero_grad(set_to_none=True)
    plain.zero_grad(set_to_none=True)
    before = comm.bytes_moved["all_gather"]
    with torch.set_grad_enabled(backward):
        ours, reference = ours_call(), plain_call()
        if backward:
            ours.square().mean().backward()
            reference.square().mean().backward()
    sizes = gathered_bytes(sharded)
    if ours.shape != reference.shape:  # ours is this rank's share of the batch
        reference = local_part(reference, comm.rank, comm.world_size)
    result = {"output_error": comm.all_reduce_max_float(relative_error(ours.detach(), reference.detach())),
              "gathered_as_expected": comm.bytes_moved["all_gather"] - before
              == sum(sizes[unit] * times for unit, times in expected_units.items()),
              "freed_after": not still_gathered(sharded)}
    if backward:
        result["gradient_error"] = comm.all_reduce_max_float(gradient_error(sharded, plain))
    return {f"{name}/{key}": value for key, value in result.items()}


def gpt2_cases(comm: Communicator) -> dict:
    from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config

    torch.manual_seed(0)
    plain = GPT2LMHeadModel(gpt2_config("gpt2-tiny", dropout=0.0)).double()
    sharded = FullyShardedDataParallel(copy.deepcopy(plain), comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    tokens = torch.randint(0, 65, (2 * comm.world_size, 8), generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(2 * comm.world_size, 8, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    mine = local_part(tokens, comm.rank, comm.world_size)
    my_hidden = local_part(hidden, comm.rank, comm.world_size)
    # Each rank's loss is the mean over its share, and fsdp_mpi averages the ranks' gradients: the global mean's.
    inside_root, inside_block = sharded.module.transformer, sharded.module.transformer.h[1].mlp
    report = {}
    report |= call(comm, sharded, plain, "root_part_no_grad", lambda: inside_root.wte(tokens),
                   lambda: plain.transformer.wte(tokens), False, {"<root>": 1})
    report |= call(comm, sharded, plain, "root_part_autograd",
                   lambda: inside_root(mine), lambda: plain.transformer(tokens), True,
                   {"<root>": 1, "transformer.h.0": 2, "transformer.h.1": 2})
    report |= call(comm, sharded, plain, "nested_part_autograd", lambda: inside_block(my_hidden),
                   lambda: plain.transformer.h[1].mlp(hidden), True, {"transformer.h.1": 2})
    return report


def t5_cases(comm: Communicator) -> dict:
    from transformers import T5Config, T5ForConditionalGeneration
    from transformers.models.t5.modeling_t5 import T5Block

    config = T5Config(vocab_size=48, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    torch.manual_seed(0)
    plain = T5ForConditionalGeneration(config).double()
    sharded = FullyShardedDataParallel(copy.deepcopy(plain), comm=comm, auto_wrap_policy=ModuleWrapPolicy({T5Block}))
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randint(2, 48, (2 * comm.world_size, 7), generator=generator)
    labels = torch.randint(2, 48, (2 * comm.world_size, 5), generator=generator)
    mine, my_labels = local_part(inputs, comm.rank, comm.world_size), local_part(labels, comm.rank, comm.world_size)
    report = {}
    # One training step's gradients (a mean over tokens, each rank on its share).
    sharded(input_ids=mine, labels=my_labels).loss.backward()
    plain(input_ids=inputs, labels=labels).loss.backward()
    report["t5_train/gradient_error"] = comm.all_reduce_max_float(gradient_error(sharded, plain))
    report["t5_train/freed_after"] = not still_gathered(sharded)
    # Greedy generation: the encoder alone, then the decoder token by token, on every rank's own prompts.
    with torch.no_grad():
        ours = sharded.generate(input_ids=mine, max_new_tokens=6, do_sample=False)
        reference = plain.generate(input_ids=mine, max_new_tokens=6, do_sample=False)
    report["t5_generate/same_tokens"] = all(comm.all_gather_object(torch.equal(ours, reference)))
    report["t5_generate/length"] = ours.shape[1]
    report["t5_generate/freed_after"] = not still_gathered(sharded)
    return report


if __name__ == "__main__":
    communicator = Communicator()
    write_json(output_path(), gpt2_cases(communicator) | t5_cases(communicator))

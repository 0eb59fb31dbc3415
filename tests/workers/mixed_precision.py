"""Mixed precision observed on several ranks: dtypes where they are claimed, bytes moved, the fp16 scaler.

(Equivalence of bf16 training with one process under the same policy is in equivalence.py.)
"""

import torch
from common import gpt_batch, local_part, output_path, write_json

from fsdp_mpi import (Communicator, FullyShardedDataParallel, MixedPrecision, ModuleWrapPolicy, ShardedGradScaler,
                      full_state_dict, summon_full_params)
from fsdp_mpi.sharding.lifecycle import units_with_names
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config


def build(comm, mixed_precision=None):
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    model.register_buffer("float_buffer", torch.ones(3))
    return FullyShardedDataParallel(model, comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
                                    mixed_precision=mixed_precision)


def loss_of(model, comm, batch_index=0):
    inputs, targets = gpt_batch(batch_index, 128)
    _, loss = model(local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank, comm.world_size))
    return loss


def one_step_bytes(model, comm) -> dict:
    comm.bytes_moved.clear()
    loss_of(model, comm).backward()
    return dict(comm.bytes_moved)


def dtypes_seen(comm) -> dict:
    """The dtype of each thing the policy table in mixed_precision.py names."""
    model = build(comm, MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.float16))
    seen = {}
    block = model.module.transformer.h[0]
    hook = block.attn.c_attn.register_forward_hook(
        lambda module, args, output: seen.update(weight=str(module.weight.dtype), input=str(args[0].dtype)))
    logits, loss = model(*(local_part(t, comm.rank, comm.world_size) for t in gpt_batch(0, 128)))
    hook.remove()
    seen["logits"], seen["loss"] = str(logits.dtype), str(loss.dtype)
    loss.backward()
    seen["shard"] = sorted({str(h.shard.dtype) for _, u in units_with_names(model) for h in u.handles})
    seen["grad"] = sorted({str(p.grad.dtype) for p in model.parameters() if p.grad is not None})
    seen["buffer"] = str(model.module.float_buffer.dtype)
    seen["state_dict"] = sorted({str(v.dtype) for k, v in full_state_dict(model, rank0_only=False).items()
                                 if k != "float_buffer" and v.is_floating_point()})
    with summon_full_params(model, writeback=False):
        seen["summoned"] = str(model.module.lm_head.weight.dtype)
    return seen


def state_dict_is_the_masters(comm) -> bool:
    """After bf16 training, the state dict holds the fp32 masters exactly, not their bf16 rounding."""
    model = build(comm, MixedPrecision(param_dtype=torch.bfloat16))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss_of(model, comm).backward()
    optimizer.step()
    state = full_state_dict(model, rank0_only=False)
    masters = {}
    for prefix, unit in units_with_names(model):
        for handle in unit.handles:
            full = handle.gather_masters()
            for slot, tensor in zip(handle.slots, handle.split_full(full)):
                masters[f"{prefix}.{slot.uses[0].name}" if prefix else slot.uses[0].name] = tensor
    rounded_away = any(not torch.equal(v, v.bfloat16().float()) for v in masters.values())
    return rounded_away and all(torch.equal(state[name], tensor) for name, tensor in masters.items())


def scaler_skips_everywhere(comm) -> dict:
    """fp16 with the scaler: an inf in one rank's shard of the gradient skips the step on every rank."""
    model = build(comm, MixedPrecision(param_dtype=torch.float16))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scaler = ShardedGradScaler(comm, init_scale=2.0**10, growth_interval=2)
    history = []
    for step in range(4):
        before = [p.detach().clone() for p in model.parameters()]
        scaler.scale(loss_of(model, comm, step)).backward()
        if step == 1 and comm.rank == comm.world_size - 1:
            next(p for p in model.parameters() if p.numel()).grad[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        history.append({"changed": comm.all_gather_object(changed), "finite": comm.all_gather_object(finite),
                        "scale": comm.all_gather_object(scaler.get_scale())})
    return {"history": history, "skipped": comm.all_gather_object(scaler.skipped_steps)}


if __name__ == "__main__":
    comm = Communicator()
    report = {
        "bytes_fp32": one_step_bytes(build(comm), comm),
        "bytes_bf16": one_step_bytes(build(comm, MixedPrecision(param_dtype=torch.bfloat16)), comm),
        "bytes_bf16_reduce_bf16": one_step_bytes(
            build(comm, MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)), comm),
        "dtypes": comm.all_gather_object(dtypes_seen(comm)),
        "state_dict_is_the_masters": all(comm.all_gather_object(state_dict_is_the_masters(comm))),
        "scaler": scaler_skips_everywhere(comm),
    }
    write_json(output_path(), report)

"""Sharded checkpoints, deferred initialisation and Hugging Face export (run under mpiexec).

    checkpoint.py OUT train DIR STOP [--save-at K [--full-at-save]] [--resume FROM] [--save-after-load TO
                  [--reload-full FILE]] [--dropout P] [--offload]
    checkpoint.py OUT crash DIR          rank 1 dies while writing the second checkpoint
    checkpoint.py OUT mismatch DIR       a GPT-2 checkpoint loaded into BERT
    checkpoint.py OUT deferred           meta-device models against eager ones
    checkpoint.py OUT export DIR         export_pretrained, then load_pretrained on a meta-built model

`train` runs gpt2-tiny with dropout (so the random generators matter), AdamW with
decay/no-decay groups and a warm-up schedule, on batches fixed per step; it writes
each step's loss and saves DIR/final at the end.
"""

import argparse
import os
import signal
import sys
from dataclasses import replace

import torch
from common import gpt_batch, local_part, write_json

from fsdp_mpi import (CheckpointError, Communicator, CPUOffload, FullyShardedDataParallel, ModuleWrapPolicy,
                      export_pretrained, full_optimizer_state_dict, full_state_dict, load_checkpoint,
                      load_full_optimizer_state_dict, load_full_state_dict, load_pretrained, save_checkpoint)
from fsdp_mpi.files.safetensors_file import SafetensorsWriter
from fsdp_mpi_models.bert import BertForPreTraining, BertLayer, bert_config
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, checkpoint_key_to_name, config_to_hf, gpt2_config

GPT2 = gpt2_config("gpt2-tiny", dropout=0.1)
PADDED_GPT2 = replace(GPT2, vocab_size=100)  # 128 rows in memory, 100 in Hugging Face's files


def wrapped_gpt2(seed: int = 0, meta: bool = False, dropout: float = GPT2.dropout, config=GPT2,
                 offload: bool = False):
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model = GPT2LMHeadModel(replace(config, dropout=dropout))
    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
                                    param_init_fn=model.init_module if meta else None,
                                    cpu_offload=CPUOffload(offload_params=True) if offload else None)


def recipe(model):
    decay = [p for n, p in model.named_parameters() if n.endswith("weight") and ".ln_" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (n.endswith("weight") and ".ln_" not in n)]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))
    return optimizer, scheduler


def train_step(model, optimizer, scheduler, comm, step: int) -> float:
    vocab_size = model.module.config.vocab_size
    inputs, targets = (local_part(t, comm.rank, comm.world_size) for t in gpt_batch(step, vocab_size))
    loss = model(inputs, targets)[1]
    loss.backward()
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return comm.all_reduce_sum_float(loss.item()) / comm.world_size


def train(args, comm) -> dict:
    model = wrapped_gpt2(seed=comm.rank + 7, dropout=args.dropout, offload=args.offload)  # rank 0's weights are broadcast; a resume overwrites them anyway
    optimizer, scheduler = recipe(model)
    torch.manual_seed(100 + comm.rank)  # dropout masks differ per rank
    step = 0
    if args.resume:
        extra = load_checkpoint(args.resume, model, optimizer)
        scheduler.load_state_dict(extra["scheduler"])
        step = extra["step"]
        if args.save_after_load:
            save_checkpoint(args.save_after_load, model, optimizer, extra=extra)
        if args.reload_full:  # the same state again, from its full form on every rank, saved again
            full = torch.load(args.reload_full, weights_only=True)
            load_full_state_dict(model, full["model"])
            load_full_optimizer_state_dict(model, optimizer, full["optimizer"])
            save_checkpoint(args.save_after_load + "-full", model, optimizer, extra=extra)
    losses = {}
    while step < args.stop:
        losses[step] = train_step(model, optimizer, scheduler, comm, step)
        step += 1
        if step == args.save_at:
            save_checkpoint(os.path.join(args.dir, "ckpt"), model, optimizer,
                            extra={"step": step, "scheduler": scheduler.state_dict()})
            if args.full_at_save:  # the same state whole, gathered to rank 0: what a one-file checkpoint holds
                full = {"model": full_state_dict(model), "optimizer": full_optimizer_state_dict(model, optimizer)}
                if comm.rank == 0:
                    torch.save(full, os.path.join(args.dir, "ckpt-full.pt"))
    save_checkpoint(os.path.join(args.dir, "final"), model, optimizer, extra={"step": step})
    return {"losses": losses}


def crash(args, comm) -> dict:
    """A good checkpoint after step 1; rank 1 is killed while writing the one after step 2."""
    model = wrapped_gpt2()
    optimizer, scheduler = recipe(model)
    train_step(model, optimizer, scheduler, comm, 0)
    target = os.path.join(args.dir, "ckpt")
    save_checkpoint(target, model, optimizer, extra={"step": 1, "scheduler": scheduler.state_dict()})
    write_json(sys.argv[1], {"saved": True})
    train_step(model, optimizer, scheduler, comm, 1)
    if comm.rank == 1:
        original = SafetensorsWriter.write

        def write_then_die(self, tensor):
            original(self, tensor)
            os.kill(os.getpid(), signal.SIGKILL)

        SafetensorsWriter.write = write_then_die
    save_checkpoint(target, model, optimizer, extra={"step": 2, "scheduler": scheduler.state_dict()})
    return {"unreachable": True}


def mismatch(args, comm) -> dict:
    torch.manual_seed(0)
    model = FullyShardedDataParallel(BertForPreTraining(bert_config("bert-tiny", vocab_size=100)),
                                     auto_wrap_policy=ModuleWrapPolicy({BertLayer}))
    before = full_state_dict(model, rank0_only=False)
    try:
        load_checkpoint(args.dir, model)
        message = None
    except CheckpointError as error:
        message = str(error)
    after = full_state_dict(model, rank0_only=False)
    return {"error": message, "unchanged": all(torch.equal(before[k], after[k]) for k in before)}


def deferred(args, comm) -> dict:
    """Meta-built GPT-2 and BERT, each rank seeded differently, against eager ones seeded like rank 0."""
    result = {}
    bert = bert_config("bert-tiny", vocab_size=100)
    for name, cls, config, block in (("gpt2", GPT2LMHeadModel, GPT2, GPT2Block), ("bert", BertForPreTraining, bert,
                                                                                  BertLayer)):
        torch.manual_seed(1234 + comm.rank)
        with torch.device("meta"):
            model = cls(config)
        wrapped = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({block}),
                                           param_init_fn=model.init_module)
        sharded = full_state_dict(wrapped, rank0_only=False)
        torch.manual_seed(1234)
        eager = cls(config).state_dict()
        result[name] = {"keys": sorted(eager) == sorted(sharded),
                        "differing": [k for k in eager if not torch.equal(eager[k], sharded[k])]}
        # Deferred training works: one step, then the loss is finite.
        inputs = local_part(gpt_batch(0, GPT2.vocab_size)[0], comm.rank, comm.world_size) if name == "gpt2" else None
        if inputs is not None:
            result[name]["loss"] = wrapped(inputs, inputs)[1].item()
    result["errors"] = deferred_errors()
    return result


def deferred_errors() -> dict:
    """What bad deferred-initialisation input says (checked collectively, so every rank raises)."""
    messages = {}

    class NoReset(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(4, 4))

    class Parent(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = torch.nn.Parameter(torch.empty(4))
            self.child = torch.nn.Linear(4, 4)

    def touches_children(module):
        for param in module.parameters():  # recurse=True: the child's sharded view too
            param.fill_(1.0)

    def mixed():
        model = torch.nn.Sequential(torch.nn.Linear(2, 2))
        with torch.device("meta"):
            model.append(torch.nn.Linear(2, 2))
        return FullyShardedDataParallel(model)

    cases = {
        "no_reset": lambda: FullyShardedDataParallel(_on_meta(NoReset)),
        "touches_children": lambda: FullyShardedDataParallel(_on_meta(Parent), param_init_fn=touches_children),
        "mixed": mixed,
    }
    for name, make in cases.items():
        try:
            make()
            messages[name] = None
        except (TypeError, RuntimeError, ValueError) as error:
            messages[name] = f"{type(error).__name__}: {error}"
    return messages


def _on_meta(cls):
    with torch.device("meta"):
        return cls()


def export(args, comm) -> dict:
    """Export a trained model (its vocabulary padded in memory) in pieces of at most 100 kB; load it back into
    a meta-built model."""
    model = wrapped_gpt2(config=PADDED_GPT2)
    optimizer, scheduler = recipe(model)
    train_step(model, optimizer, scheduler, comm, 0)
    expected = full_state_dict(model, rank0_only=False)
    if comm.rank == 0:
        torch.save(expected, os.path.join(args.dir, "expected.pt"))
    hf_dir = os.path.join(args.dir, "hf")
    rows = model.module.checkpoint_rows()
    export_pretrained(model, hf_dir, config=config_to_hf(PADDED_GPT2), max_file_bytes=100_000, rows=rows)
    fresh = wrapped_gpt2(meta=True, config=PADDED_GPT2)
    with torch.no_grad():  # what loading must overwrite: the padding rows too
        for param in fresh.parameters():
            param.fill_(1.0)
    load_pretrained(fresh, hf_dir, key_map=checkpoint_key_to_name, rows=rows)
    loaded = full_state_dict(fresh, rank0_only=False)
    inputs = gpt_batch(0, PADDED_GPT2.vocab_size)[0]
    model.eval(), fresh.eval()
    with torch.no_grad():
        logit_difference = float((model(inputs)[0] - fresh(inputs)[0]).abs().max())
    try:
        load_pretrained(fresh, os.path.join(hf_dir, "missing.safetensors"))
        bad_path = None
    except ValueError as error:
        bad_path = str(error)
    return {"differing": [k for k in expected if not torch.equal(expected[k], loaded[k])],
            "logit_difference": logit_difference, "bad_path": bad_path}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("mode", choices=["train", "crash", "mismatch", "deferred", "export"])
    parser.add_argument("dir", nargs="?")
    parser.add_argument("stop", nargs="?", type=int)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume")
    parser.add_argument("--save-after-load")
    parser.add_argument("--full-at-save", action="store_true",
                        help="beside the checkpoint, DIR/ckpt-full.pt: full_state_dict and full_optimizer_state_dict")
    parser.add_argument("--reload-full", help="after the resume, load this full state and save it to "
                                              "SAVE_AFTER_LOAD-full")
    parser.add_argument("--dropout", type=float, default=GPT2.dropout)
    parser.add_argument("--offload", action="store_true", help="the shards and optimizer state in host memory")
    arguments = parser.parse_args()
    communicator = Communicator()
    write_json(arguments.out, globals()[arguments.mode](arguments, communicator))

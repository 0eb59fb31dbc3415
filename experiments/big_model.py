"""Memory of a model bigger than a rank, and sharded checkpoint speed (run under mpiexec).

    mpiexec -n 2 python experiments/big_model.py --model gpt2-large --optimizer adamw
    mpiexec -n 2 python experiments/big_model.py --model gpt2-xl --optimizer sgd-stateless
    mpiexec -n 2 python experiments/big_model.py --model gpt2-medium --steps 1 --checkpoint-dir /tmp/ckpt
    python experiments/big_model.py --model gpt2-medium --unwrapped     # what plain torch needs beyond its state
    mpiexec -n 2 python experiments/big_model.py --model gpt2-medium --unwrapped-beyond-state-mib 650

Builds the model on the meta device and initialises it in shards (deferred
initialisation), then takes optimizer steps on random tokens. Each phase's peak
resident memory per rank is measured from the kernel's high-water mark (VmHWM,
reset between phases), beside what the phase should hold: the fp32 shard, the
largest unit, gradients and optimizer state. With --checkpoint-dir it also times
save_checkpoint and load_checkpoint against torch.save/torch.load of the full
state dict (gathered on rank 0). Prints one table from rank 0.

A step's peak against its bound: ``--unwrapped`` trains the same model unsharded in
one process and prints what its peak holds beyond the parameters, gradients and
optimizer state (activations, autograd's gradients in flight, temporaries); given
that figure, ``--unwrapped-beyond-state-mib``, a sharded run prints its peak over the
bound, sharded state plus that.
"""

import argparse
import os
import shutil
import time
from pathlib import Path

import torch
from measuring.profiling import saved_tensor_bytes
from training.results import peak_resident_bytes, reset_peak_resident, resident_bytes

MIB = 2**20


class GatheredWatch:
    """The most memory that gathered units and their assembled full gradients held at once, read at each
    block's entry and exit in forward (inside the unit's own gather and free) and in backward."""

    def __init__(self, model, handles):
        self.handles, self.peak_bytes = handles, 0
        for module in model.modules():
            if type(module).__name__ == "GPT2Block":
                module.register_forward_pre_hook(self.read)  # after the unit's gather (it is prepended)
                module.register_forward_hook(self.read, prepend=True)  # before the unit's free
                module.register_full_backward_pre_hook(self.read)
                module.register_full_backward_hook(self.read)

    def read(self, *_):
        held = sum(handle.gathered_bytes + handle.gradient.unsharded_bytes for handle in self.handles)
        self.peak_bytes = max(self.peak_bytes, held)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-large")
    parser.add_argument("--optimizer", choices=["adamw", "adamw-fused", "adamw-foreach", "sgd", "sgd-stateless"],
                        default="adamw", help="adamw (torch's default implementation), -fused or -foreach: 8 bytes of "
                                              "state per parameter; sgd: momentum, 4 bytes; sgd-stateless: none")
    parser.add_argument("--steps", type=int, default=3, help="from the third on, step k+1's memory is compared "
                                                                 "with step k's")
    parser.add_argument("--warmup", type=int, default=0, help="steps before the training peak is measured (the "
                                                               "peak of a settled step, not of the first ones)")
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--checkpoint-dir", type=Path)
    parser.add_argument("--unwrapped", action="store_true",
                        help="one process, the model unsharded: prints what the peak holds beyond the state")
    parser.add_argument("--unwrapped-beyond-state-mib", type=float,
                        help="what --unwrapped printed for this batch: the sharded peak is then shown over "
                             "the bound, sharded state plus this")
    return parser.parse_args()


class Phases:
    """Each phase's peak and current resident memory per rank beside what it should hold, as table rows; the
    peak (VmHWM) starts again after each phase."""

    def __init__(self):
        reset_peak_resident()
        self.rows = []

    def record(self, phase: str, expected_mib: float, note: str) -> None:
        self.rows.append((phase, peak_resident_bytes() / MIB, resident_bytes() / MIB, expected_mib, note))
        reset_peak_resident()


def optimizer_for(name: str, model) -> tuple[torch.optim.Optimizer, int]:
    """--optimizer's optimizer over `model`'s (sharded) parameters, and its state's bytes per parameter."""
    if name.startswith("sgd"):
        momentum = 0.9 if name == "sgd" else 0.0
        return torch.optim.SGD(model.parameters(), lr=1e-4, momentum=momentum), 4 if momentum else 0
    # foreach (torch's default on CPU) makes temporaries as large as all the state it steps at once
    implementation = {"adamw": {}, "adamw-fused": {"fused": True}, "adamw-foreach": {"foreach": True}}
    return torch.optim.AdamW(model.parameters(), lr=1e-4, **implementation[name]), 8


def train(args, model, optimizer, weights: set) -> tuple[float, list[float], list[float], int]:
    """--steps optimizer steps on random tokens: (the last loss, each step's seconds, the resident MiB after each
    step, the bytes of the activations the first forward saved, the storages in `weights` aside). The training
    peak restarts after --warmup."""
    vocab = model.config.vocab_size
    step_times, resident_after_step = [], []
    for step in range(args.steps):
        if step == args.warmup > 0:
            reset_peak_resident()
        tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=torch.Generator().manual_seed(step))
        start = time.perf_counter()
        if step == 0:
            with saved_tensor_bytes(weights) as activations:
                loss = model(tokens[:, :-1], tokens[:, 1:])[1]
        else:
            loss = model(tokens[:, :-1], tokens[:, 1:])[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradient: it is part of the steady state
        step_times.append(time.perf_counter() - start)
        resident_after_step.append(resident_bytes() / MIB)
    return loss.item(), step_times, resident_after_step, activations[0]


def main() -> None:
    args = arguments()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from fsdp_mpi import (FullyShardedDataParallel, ModuleWrapPolicy, full_state_dict, load_checkpoint,
                          save_checkpoint)
    from fsdp_mpi.sharding.lifecycle import units_with_names
    from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config

    phases = Phases()
    phases.record("interpreter + torch + MPI", 0.0, "baseline")
    baseline = phases.rows[0][2]
    torch.manual_seed(0)
    if args.unwrapped:
        unwrapped(args, GPT2LMHeadModel(gpt2_config(args.model)), baseline)
        return
    with torch.device("meta"):
        model = GPT2LMHeadModel(gpt2_config(args.model))
    params = model.num_parameters()
    start = time.perf_counter()
    model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
                                     param_init_fn=model.init_module)
    wrap_s = time.perf_counter() - start
    comm = model.comm
    handles = [h for _, unit in units_with_names(model) for h in unit.handles]
    shard_mib = sum(h.shard_numel for h in handles) * 4 / MIB
    largest_unit_mib = max(h.padded_numel for h in handles) * 4 / MIB
    phases.record("wrap (deferred init)", baseline + shard_mib + largest_unit_mib,
                  f"baseline + fp32 shard {shard_mib:.0f} + largest unit {largest_unit_mib:.0f}; {wrap_s:.1f} s")

    optimizer, state_bytes = optimizer_for(args.optimizer, model)
    watch = GatheredWatch(model, handles)
    loss, step_times, resident_after_step, activation_bytes = train(
        args, model, optimizer, {h.full_flat.untyped_storage()._cdata for h in handles})
    per_param = 4 + 4 + state_bytes  # parameter, gradient, optimizer state
    budget = per_param * shard_mib / 4
    measured = f"steps {args.warmup + 1}-{args.steps}" if args.warmup else f"{args.steps} training steps"
    phases.record(f"{measured} ({args.optimizer})", baseline + budget,
                  f"baseline + {per_param} B x parameters / N = {budget:.0f} (+ activations, gathered units); "
                  f"loss {loss:.3f}, last step {step_times[-1]:.1f} s")
    peak = phases.rows[-1][1]
    kinds = {"shards (fp32)": shard_mib, "gradients (sharded, fp32)": shard_mib,
             "optimizer state": state_bytes * shard_mib / 4,
             "gathered units and their full gradients (largest at once)": watch.peak_bytes / MIB,
             "activations saved by one forward": activation_bytes / MIB}
    kinds["the rest: gradients autograd holds, temporaries, allocator slack"] = peak - baseline - sum(kinds.values())
    state_mib = per_param * shard_mib / 4
    peak_over_state = (peak - baseline - activation_bytes / MIB) / state_mib
    if args.checkpoint_dir is not None:
        checkpoint_rows(args, model, optimizer, comm, full_state_dict, save_checkpoint, load_checkpoint, phases.rows)
    if comm.rank == 0:
        print(f"{args.model}: {params / 1e6:.0f} M parameters on {comm.world_size} ranks "
              f"(16 B x parameters / N = {16 * params / comm.world_size / MIB:.0f} MiB)")
        print_table(phases.rows)
        print(f"\nThe training peak ({peak:.0f} MiB) by kind, rank 0, MiB (baseline {baseline:.0f} aside):")
        for kind, mib in kinds.items():
            print(f"  {kind:58} {mib:8.0f}")
        print(f"(peak - baseline - activations) / sharded state ({state_mib:.0f} MiB) = {peak_over_state:.3f}")
        if args.unwrapped_beyond_state_mib is not None:
            bound = state_mib + args.unwrapped_beyond_state_mib
            print(f"(peak - baseline) / (sharded state + unwrapped's beyond its state = {bound:.0f} MiB) = "
                  f"{(peak - baseline) / bound:.3f}")
        print_resident_after_each_step(resident_after_step)


def unwrapped(args, model, baseline: float) -> None:
    """The model unsharded in this one process, trained as the sharded one is: what its peak holds beyond the
    parameters, their gradients and the optimizer's state (the bound's second part)."""
    optimizer, state_bytes = optimizer_for(args.optimizer, model)
    reset_peak_resident()
    loss, step_times, _, activation_bytes = train(args, model, optimizer,
                                                  {p.untyped_storage()._cdata for p in model.parameters()})
    state_mib = model.num_parameters() * (4 + 4 + state_bytes) / MIB
    beyond = peak_resident_bytes() / MIB - baseline - state_mib
    print(f"{args.model} unwrapped, one process, {args.optimizer}: loss {loss:.3f}, last step {step_times[-1]:.1f} s; "
          f"activations saved by one forward {activation_bytes / MIB:.0f} MiB")
    print(f"peak - baseline - state ({state_mib:.0f} MiB) = beyond its state: {beyond:.0f} MiB")


def print_table(rows: list[tuple]) -> None:
    print(f"{'phase':34} {'peak MiB':>9} {'now MiB':>8} {'expected MiB':>13}  note")
    for phase, phase_peak, current, expected, note in rows:
        print(f"{phase:34} {phase_peak:9.0f} {current:8.0f} {expected:13.0f}  {note}")


def print_resident_after_each_step(resident_after_step: list[float]) -> None:
    """The resident MiB after each step, and from the second step on each step's change against the one before."""
    step_to_step = [later / earlier - 1 for earlier, later in zip(resident_after_step[1:], resident_after_step[2:])]
    print("resident after each step, MiB: " + ", ".join(f"{mib:.0f}" for mib in resident_after_step)
          + ("; step k+1 against step k from the second step on: "
             + ", ".join(f"{change:+.2%}" for change in step_to_step) if step_to_step else ""))


def checkpoint_rows(args, model, optimizer, comm, full_state_dict, save_checkpoint, load_checkpoint, rows) -> None:
    """Times the sharded checkpoint and torch.save/torch.load of the gathered full state dict."""
    def timed(work) -> float:
        comm.barrier()
        start = time.perf_counter()
        work()
        comm.barrier()
        return time.perf_counter() - start

    def disk_mib(path: Path) -> float:
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        return sum(p.stat().st_size for p in files) / MIB

    sharded = args.checkpoint_dir / "sharded"
    save_s = timed(lambda: save_checkpoint(sharded, model, optimizer))
    load_s = timed(lambda: load_checkpoint(sharded, model, optimizer))
    rows.append(("save_checkpoint (params + optim)", 0, 0, 0, f"{save_s:.1f} s, {disk_mib(sharded):.0f} MiB on disk"))
    rows.append(("load_checkpoint (params + optim)", 0, 0, 0, f"{load_s:.1f} s"))
    sharded_params = args.checkpoint_dir / "sharded-params"
    save_s = timed(lambda: save_checkpoint(sharded_params, model))
    load_s = timed(lambda: load_checkpoint(sharded_params, model))
    rows.append(("save_checkpoint (params only)", 0, 0, 0, f"{save_s:.1f} s, {disk_mib(sharded_params):.0f} MiB"))
    rows.append(("load_checkpoint (params only)", 0, 0, 0, f"{load_s:.1f} s"))
    full = args.checkpoint_dir / "full.pt"

    def torch_save():
        state = full_state_dict(model)  # gathered on rank 0, {} elsewhere
        if comm.rank == 0:
            torch.save(state, full)

    save_s = timed(torch_save)
    load_s = timed(lambda: torch.load(full, weights_only=True) if comm.rank == 0 else None)
    rows.append(("torch.save(full state dict), rank 0", 0, 0, 0, f"{save_s:.1f} s incl. gather, {disk_mib(full):.0f} MiB"))
    rows.append(("torch.load(full state dict), rank 0", 0, 0, 0, f"{load_s:.1f} s"))
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(args.checkpoint_dir)


if __name__ == "__main__":
    main()

"""Memory of a model bigger than a rank, and sharded checkpoint speed (run under mpiexec).

    mpiexec -n 2 python experiments/big_model.py --model gpt2-large --optimizer adamw
    mpiexec -n 2 python experiments/big_model.py --model gpt2-xl --optimizer sgd
    mpiexec -n 2 python experiments/big_model.py --model gpt2-medium --steps 1 --checkpoint-dir /tmp/ckpt

Builds the model on the meta device and initialises it in shards (deferred
initialisation), then takes optimizer steps on random tokens. Each phase's peak
resident memory per rank is measured from the kernel's high-water mark (VmHWM,
reset between phases), beside what the phase should hold: the fp32 shard, the
largest unit, gradients and optimizer state. With --checkpoint-dir it also times
save_checkpoint and load_checkpoint against torch.save/torch.load of the full
state dict (gathered on rank 0). Prints one table from rank 0.
"""

import argparse
import os
import shutil
import time
from pathlib import Path

import torch

MIB = 2**20


def resident_mib() -> tuple[float, float]:
    """(current, peak) resident memory of this process in MiB."""
    fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def reset_peak() -> None:
    """Restarts the kernel's peak-resident counter (Linux >= 4.0)."""
    Path("/proc/self/clear_refs").write_text("5")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt2-large")
    parser.add_argument("--optimizer", choices=["adamw", "sgd"], default="adamw",
                        help="adamw: 8 bytes of state per parameter; sgd: momentum, 4 bytes")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1, help="sequences per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--checkpoint-dir", type=Path)
    args = parser.parse_args()

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from fsdp_mpi import (FullyShardedDataParallel, ModuleWrapPolicy, full_state_dict, load_checkpoint,
                          save_checkpoint)
    from fsdp_mpi.sharding.lifecycle import units_with_names
    from models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config

    rows = []

    def record(phase: str, expected_mib: float, note: str) -> None:
        current, peak = resident_mib()
        rows.append((phase, peak, current, expected_mib, note))
        reset_peak()

    reset_peak()
    record("interpreter + torch + MPI", 0.0, "baseline")
    baseline = rows[0][2]
    torch.manual_seed(0)
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
    record("wrap (deferred init)", baseline + shard_mib + largest_unit_mib,
           f"baseline + fp32 shard {shard_mib:.0f} + largest unit {largest_unit_mib:.0f}; {wrap_s:.1f} s")

    if args.optimizer == "adamw":
        optimizer, state_bytes = torch.optim.AdamW(model.parameters(), lr=1e-4), 8
    else:
        optimizer, state_bytes = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9), 4
    vocab = model.config.vocab_size
    step_times = []
    for step in range(args.steps):
        tokens = torch.randint(0, vocab, (args.batch_size, args.seq_len + 1), generator=torch.Generator().manual_seed(step))
        start = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradient: it is part of the steady state
        step_times.append(time.perf_counter() - start)
    per_param = 4 + 4 + state_bytes  # parameter, gradient, optimizer state
    budget = per_param * shard_mib / 4
    record(f"{args.steps} training steps ({args.optimizer})", baseline + budget,
           f"baseline + {per_param} B x parameters / N = {budget:.0f} (+ activations, gathered units); "
           f"loss {loss.item():.3f}, last step {step_times[-1]:.1f} s")

    if args.checkpoint_dir is not None:
        checkpoint_rows(args, model, optimizer, comm, full_state_dict, save_checkpoint, load_checkpoint, rows)
    if comm.rank == 0:
        print(f"{args.model}: {params / 1e6:.0f} M parameters on {comm.world_size} ranks "
              f"(16 B x parameters / N = {16 * params / comm.world_size / MIB:.0f} MiB)")
        print(f"{'phase':34} {'peak MiB':>9} {'now MiB':>8} {'expected MiB':>13}  note")
        for phase, peak, current, expected, note in rows:
            print(f"{phase:34} {peak:9.0f} {current:8.0f} {expected:13.0f}  {note}")


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

"""Side-by-side step times and memory of fsdp-mpi, plain torch, torch FSDP2, DDP and Lightning DDP.

    python experiments/bench.py --model gpt2-seed --ranks 2 --batch-size 8 --seq-len 256

Runs, one after another on this machine, the same GPT-2 on the same synthetic
tokens with the same per-rank batch and threads: plain single-process torch,
fsdp-mpi on 1 and on N ranks, then torch FSDP2, torch DDP and Lightning DDP on N
ranks. Warm-up steps are excluded; step times are medians of the slowest rank.
Prints a table with each strategy's step time divided by fsdp-mpi's and writes it
as CSV. A strategy whose model state would not fit in this machine's memory is
not started; its row gives the computed requirement instead.

fsdp-mpi's overlap mechanisms are measured as extra strategies:
``fsdp-mpi+forward_prefetch+backward_prefetch+async_reduce_scatter`` (any subset).
A ``:PRECISION`` suffix (``fsdp-mpi:bf16-mixed``, ``ddp:bf16-mixed``) picks the
experiments' ``--precision``; ``comm_mb_per_step`` is what fsdp-mpi's collectives
moved per step on one rank. For comparisons on a noisy machine, run bench.py
several times and compare the rows of each round (A B A B ...), not single runs.
``--tune-malloc-for-all`` gives every strategy the glibc setting fsdp-mpi uses on
CPU (see fsdp_mpi/host_memory.py), to separate that effect from sharding.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from models.gpt2 import GPT2_CONFIGS, GPT2LMHeadModel, gpt2_config

PRECISIONS = ("32", "bf16-mixed", "16-mixed")  # as in the experiments' --precision

REPLICATED = ("plain", "ddp", "lightning-ddp")
BYTES_PER_PARAMETER = 16  # fp32 parameter, gradient and two Adam moments
FIELDS = ["strategy", "precision", "ranks", "step_s", "vs_fsdp_mpi", "tokens_per_s", "tflops", "mfu", "model_state_mb",
          "peak_rss_mb", "mpi_blocked_s", "compute_s", "overhead_s", "comm_mb_per_step", "note"]


def available_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


OVERLAP = ("forward_prefetch", "backward_prefetch", "async_reduce_scatter")
MALLOC_REUSE = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"


def run_one(spec: str, ranks: int, args) -> dict:
    """Launches bench_worker.py for one strategy; its JSON, or a row explaining why there is none."""
    spec, _, precision = spec.partition(":")
    precision = precision or "32"
    strategy, *overlap = spec.split("+")
    parameters = parameter_count(args)
    needed = ranks * BYTES_PER_PARAMETER * parameters if strategy in REPLICATED else 0
    if needed > available_memory_bytes():
        return {"strategy": spec, "precision": precision, "ranks": ranks,
                "note": f"not run: model state needs {needed / 2**30:.1f} GiB "
                        f"({ranks} x 16 B x {parameters:,}), {available_memory_bytes() / 2**30:.1f} GiB available"}
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "result.json"
        mpiexec = Path(sys.executable).parent / "mpiexec"
        command = [str(mpiexec) if mpiexec.exists() else "mpiexec", "-n", str(ranks), sys.executable,
                   str(Path(__file__).parent / "bench_worker.py"), "--strategy", strategy, "--json", str(output),
                   "--model", args.model, "--vocab-size", str(args.vocab_size), "--batch-size", str(args.batch_size),
                   "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
                   "--threads", str(args.threads), "--overlap", "+".join(overlap), "--precision", precision,
                   "--sharding-strategy", args.sharding_strategy]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        if args.tune_malloc_for_all:
            env["GLIBC_TUNABLES"] = MALLOC_REUSE
        print(f"-- {spec} on {ranks} rank(s)", flush=True)
        finished = subprocess.run(command, env=env, capture_output=True, text=True)
        if finished.returncode != 0 or not output.exists():
            last_line = (finished.stderr.strip().splitlines() or ["no output"])[-1]
            return {"strategy": spec, "precision": precision, "ranks": ranks, "note": f"failed (exit {finished.returncode}): {last_line}"}
        return json.loads(output.read_text())


def parameter_count(args) -> int:
    """The model's parameter count, built on the meta device (no memory used)."""
    import torch

    with torch.device("meta"):
        return GPT2LMHeadModel(gpt2_config(args.model, vocab_size=args.vocab_size)).num_parameters()


def table(rows: list[dict]) -> list[dict]:
    """Adds the ratios to fsdp-mpi on N ranks and splits its step into compute, MPI and overhead."""
    by_key = {(r["strategy"], r.get("precision"), r["ranks"]): r for r in rows}
    ours = max((r for r in rows if r["strategy"] == "fsdp-mpi" and r.get("precision") == "32" and "step_s" in r),
               key=lambda r: r["ranks"], default=None)
    for row in rows:
        if ours and "step_s" in row:
            row["vs_fsdp_mpi"] = row["step_s"] / ours["step_s"]
        # every fsdp-mpi variant's step splits into plain compute (same precision), time blocked in MPI and the rest
        plain = by_key.get(("plain", row.get("precision"), 1), {})
        if row["strategy"].startswith("fsdp-mpi") and "step_s" in row and "step_s" in plain:
            row["compute_s"] = plain["step_s"]  # the same per-rank work, without sharding
            row["overhead_s"] = row["step_s"] - plain["step_s"] - row["mpi_blocked_s"]
    return rows


def print_table(rows: list[dict]) -> None:
    def cell(value):
        return f"{value:.4g}" if isinstance(value, float) else ("" if value is None else str(value))

    print("| " + " | ".join(FIELDS) + " |")
    print("| " + " | ".join("---" for _ in FIELDS) + " |")
    for row in rows:
        print("| " + " | ".join(cell(row.get(field)) for field in FIELDS) + " |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-seed", choices=list(GPT2_CONFIGS))
    parser.add_argument("--vocab-size", type=int, default=50257, help="default: GPT-2's BPE")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--strategies", default="plain,fsdp-mpi@1,fsdp-mpi,torch-fsdp,ddp,lightning-ddp",
                        help="comma-separated; NAME@K runs NAME on K ranks instead of --ranks")
    parser.add_argument("--sharding-strategy", default="FULL_SHARD",
                        choices=("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD"),
                        help="fsdp-mpi's; HYBRID_SHARD groups by node unless FSDP_MPI_HYBRID_GROUP_SIZE is set "
                             "(default: %(default)s)")
    parser.add_argument("--tune-malloc-for-all", action="store_true",
                        help="give every strategy fsdp-mpi's glibc memory-reuse setting")
    parser.add_argument("--out", default="results/bench.csv")
    args = parser.parse_args()
    if min(args.ranks, args.batch_size, args.seq_len, args.steps, args.threads) < 1 or args.warmup < 0:
        parser.error("--ranks, --batch-size, --seq-len, --steps and --threads must be positive")
    if args.seq_len > gpt2_config(args.model).n_positions:
        parser.error(f"--seq-len exceeds {args.model}'s context of {gpt2_config(args.model).n_positions}")
    plan = []
    for item in args.strategies.split(","):
        name, _, ranks = item.strip().partition("@")
        base, *overlap = name.partition(":")[0].split("+")
        if base not in ("plain", "fsdp-mpi", "torch-fsdp", "ddp", "lightning-ddp") or not set(overlap) <= set(OVERLAP) \
                or (overlap and base != "fsdp-mpi"):
            parser.error(f"unknown strategy {name!r}")
        if name.partition(":")[2] not in ("", *PRECISIONS):
            parser.error(f"{item!r}: the precision after : must be one of {', '.join(PRECISIONS)}")
        if ranks and not ranks.isdigit():
            parser.error(f"{item!r}: the rank count after @ must be a number")
        plan.append((name, 1 if name == "plain" else int(ranks or args.ranks)))
    rows = table([run_one(name, ranks, args) for name, ranks in plan])
    print(f"\n{args.model}, vocabulary {args.vocab_size}, batch {args.batch_size} x {args.seq_len} tokens per rank, "
          f"{args.threads} thread(s) per rank, median of {args.steps} steps after {args.warmup} warm-up\n")
    print_table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "batch_size", "seq_len", "threads", *FIELDS],
                                extrasaction="ignore")
        writer.writeheader()
        for row in rows:
            writer.writerow({"model": args.model, "batch_size": args.batch_size, "seq_len": args.seq_len,
                             "threads": args.threads, **row})
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

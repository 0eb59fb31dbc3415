"""Fair, interleaved step times of fsdp-mpi beside plain torch, torch FSDP2, DDP and Lightning DDP.

    python experiments/bench.py --model gpt2-seed --ranks 2 --batch-size 8 --seq-len 256 --rounds 5

Every strategy trains the same GPT-2 (or BERT: ``--model bert-base``, pre-training with
its masked-LM head on the 15% masked tokens, ``measuring/bench_models.py``) on the same synthetic tokens with the same
per-rank batch, threads and glibc allocator setting (fsdp-mpi's memory reuse,
fsdp_mpi/sharding/host_memory.py; ``--malloc-as-shipped`` gives it to fsdp-mpi alone, as
a user would run them). A shared machine drifts by more than the differences
between strategies, so a strategy is only compared with the others of its
round: each of ``--rounds`` rounds runs every strategy once, in an order
rotated by one per round (A B C, B C A, C A B, ...). Per strategy the table
gives the median over rounds of its step time (each round's: the median of
the slowest rank's steps after warm-up) with the min and max, and
``fsdp_mpi_ratio``: fsdp-mpi's step on as many ranks at the same precision
divided by this strategy's, the median of the per-round ratios with their min
and max (below 1: fsdp-mpi is faster). ``step_peak_rss_mb`` is the busiest
rank's peak resident memory over the timed steps (the kernel's high-water mark,
started again as they start: a settled step's peak, where ``peak_rss_mb`` also
holds the build's), and ``fsdp_mpi_peak_ratio`` fsdp-mpi's over this
strategy's, per round likewise (below 1: fsdp-mpi needs less). Beside wall time: CPU seconds per step
(user + system, busiest rank), model-state and peak memory per rank, bytes of
collectives per step, the time fsdp-mpi's ranks were blocked in MPI, and
``beyond_plain_s``, a strategy's step minus plain torch's in the same round
(communication that computation does not hide, plus the wrapper's own work).
``scaling_efficiency`` is a strategy's tokens/s per rank over plain torch's on
one rank in the same round (with the same per-rank batch: weak scaling);
``plain@N`` runs plain torch on N ranks at once, each alone, which is what
the hardware itself allows N ranks (they share memory bandwidth and caches).
fsdp-mpi's step is also broken down (``measuring/breakdown.py``, the slowest
rank's): compute, gradient assembly, the hooks' own work, and MPI split into
waiting for the slower rank and moving data; a second table prints it and
``--figure`` (default beside ``--out``) draws every strategy's step so.
Writes the summary to ``--out`` and every run of every round beside it
(``*-rounds.csv``, rewritten as each run ends, so that a bench cut short keeps
the runs it finished). A strategy whose model state would not fit in this
machine's memory is not started; its row gives the computed requirement.

On a GPU (``--device cuda``, each rank on the GPU of its place on its node;
several ranks may share one): steps are timed to the GPU's end of the step, MFU
is against the GPU's published dense peak for the compute dtype
(``results.PUBLISHED_DENSE_PEAK_FLOPS``; measured where the GPU is not listed)
counting each GPU in use once, ``issued_s`` is when the host had handed the
whole step to the GPU, before waiting for it to finish (close to ``step_s``: the
step is bound by the host, not the GPU; on a CPU they are one), ``peak_gpu_mb``
is the busiest rank's peak GPU memory (torch's allocator's, plus the node
transport's slots, which it does not see), and ``hidden_fraction`` is the share
of fsdp-mpi's time in collectives that its step does not add to plain torch's,
``1 - beyond_plain_s / mpi_blocked_s`` (0: nothing overlaps; 1: all of it is
hidden). DDP and FSDP2 use nccl there, which needs a GPU per rank: with fewer
GPUs their rows say they were not run.

fsdp-mpi's overlap mechanisms are measured as extra strategies:
``fsdp-mpi+forward_prefetch+backward_prefetch+async_reduce_scatter`` (any subset).
``plain+compile``, ``fsdp-mpi+compile`` and ``torch-fsdp+compile`` compile each GPT-2
block (BERT layer) in place (``block.compile()``, inductor); ``+compile_whole``
compiles the whole (wrapped) model (``torch.compile(model)``, inductor: fsdp-mpi's
gathers and reductions traced into its graph, docs/compiled.md#compiled-models).
Give ``--warmup 2`` or more, so that compiling is not timed; the rows' MFU then
sets compiled and eager side by side, and ``first_step_s`` (the slowest rank's
first step, warm-up or not; the median over rounds) holds the compile: compiling
costs about ``first_step_s - step_s``.
``fsdp-mpi+comm=int8/bf16`` gathers weights and reduces gradients compressed
(the experiments' ``--comm-compression``: WEIGHTS[/GRADIENTS], each none, bf16
or int8).
``fsdp-mpi+mpi`` moves the node's bytes through MPI instead of the memory its
ranks share (``FSDP_MPI_NODE_TRANSPORT=0``), as before the node transport.
``+sample_dropout`` (any strategy but Lightning's) draws dropout per sample
(``fsdp_mpi.use_sample_dropout``), as the experiments train; without it the
model's ``nn.Dropout`` draws per rank (attention's inside torch's fused kernel).
``fsdp-mpi+flat`` sends a group that spans nodes through one flat ring instead
of in two levels (``FSDP_MPI_TWO_LEVEL=0``).
``fsdp-mpi+offload`` keeps the shards, their gradients and the optimizer state
in host memory (``CPUOffload(offload_params=True)``; the experiments'
``--cpu-offload``): the device holds only the unit that computes, and the
optimizer steps on the CPU; ``torch-fsdp+offload`` is FSDP2's counterpart
(``CPUOffloadPolicy``). ``fsdp-mpi+offload+sync_copies`` makes the copies between
the two memories ones the host waits for (``FSDP_MPI_OFFLOAD_STREAMS=0``), not
on streams of their own: what the streams save.
``fsdp-mpi+step_in_backward`` steps the optimizer inside backward, each unit as
its gradient is final (``fsdp_mpi.step_in_backward``; offloaded from a GPU, on a
host thread overlapped with the rest of backward); in 32 or bf16-mixed.
``fsdp-mpi+SHARD_GRAD_OP`` (or any sharding strategy) runs fsdp-mpi with that
strategy in place of ``--sharding-strategy``, so that several share the rounds.
Where the ranks span several hosts (``FSDP_MPI_MPIEXEC`` names a launcher that
places them, docs/clusters.md), ``link_mb_per_step`` is what each host sent to the
others in one step, read from its network interfaces' byte counters.
``torch-fsdp+backend=fsdp_mpi`` and ``ddp+backend=fsdp_mpi`` run torch's FSDP2
and DDP on torch.distributed over fsdp_mpi's transports (the experiments'
``--backend``; ``backend=gloo`` names the CPU's default), so that torch's own
sharding is compared on the same transport as ours.
A ``:PRECISION`` suffix (``fsdp-mpi:bf16-mixed``, ``ddp:bf16-mixed``) picks the
experiments' ``--precision``. ``measuring/bench_plan.py`` reads these names, and
refuses one it does not know, or options that do not go together, before anything
is launched.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from measuring import bench_models, bench_report, launch
from measuring.bench_plan import ON_TORCH_DISTRIBUTED, REPLICATED, PlanError, Spec, read_plan, read_spec, variables
from measuring.costmodel import ADAM_STATE_BYTES_PER_PARAMETER, SHARDING_STRATEGIES
from measuring.reported import PARTS, median_of_known

# what bench_worker reports per run (peak_gpu_mb: on a GPU; PARTS: fsdp-mpi's step, part by part)
MEASURED = ["step_s", "first_step_s", "issued_s", "cpu_s", "tokens_per_s", "tflops", "mfu", "model_state_mb",
            "peak_rss_mb", "step_peak_rss_mb", "peak_gpu_mb", "mpi_blocked_s", "comm_mb_per_step", "link_mb_per_step",
            *PARTS]
FIELDS = ["strategy", "precision", "ranks", "rounds", "step_s", "step_s_min", "step_s_max", "fsdp_mpi_ratio",
          "fsdp_mpi_ratio_min", "fsdp_mpi_ratio_max", "scaling_efficiency", "scaling_efficiency_min",
          "scaling_efficiency_max", "first_step_s", "issued_s", "cpu_s", "tokens_per_s", "tflops", "mfu",
          "model_state_mb", "peak_rss_mb", "step_peak_rss_mb", "fsdp_mpi_peak_ratio", "fsdp_mpi_peak_ratio_min",
          "fsdp_mpi_peak_ratio_max", "peak_gpu_mb", "comm_mb_per_step", "link_mb_per_step", "mpi_blocked_s",
          "beyond_plain_s", "hidden_fraction", *PARTS, "note"]
ROUND_FIELDS = ["round", "position", "strategy", "precision", "ranks", *MEASURED, "note"]  # -rounds.csv: a row a run
MALLOC_REUSE = "glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647"


def available_memory_bytes() -> int:
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def run_one(name: str, ranks: int, args) -> dict:
    """Launches measuring/bench_worker.py for one strategy; its JSON, or a row explaining why there is none."""
    spec = read_spec(name)
    refused = refusal(spec, ranks, args)
    if refused:
        return {"strategy": spec.strategy, "precision": spec.precision, "ranks": ranks, "note": f"not run: {refused}"}
    with tempfile.TemporaryDirectory() as tmp:
        output = Path(tmp) / "result.json"
        env = launch.environment(OMP_NUM_THREADS=str(args.threads), **variables(spec.options))
        if not args.malloc_as_shipped:
            env["GLIBC_TUNABLES"] = MALLOC_REUSE
        print(f"-- {spec.strategy} on {ranks} rank(s)", flush=True)
        finished = subprocess.run(worker_command(spec, ranks, output, args), env=env, capture_output=True, text=True)
        if finished.returncode != 0 or not output.exists():
            last_line = (finished.stderr.strip().splitlines() or ["no output"])[-1]
            return {"strategy": spec.strategy, "precision": spec.precision, "ranks": ranks,
                    "note": f"failed (exit {finished.returncode}): {last_line}"}
        return json.loads(output.read_text())


def refusal(spec: Spec, ranks: int, args) -> str | None:
    """Why `spec` cannot run on `ranks` ranks here, or None: nccl's GPU per rank, a replica per rank in memory."""
    if args.device == "cuda" and spec.base in ON_TORCH_DISTRIBUTED and spec.backend in ("auto", "nccl") \
            and ranks > gpu_count():
        return f"nccl cannot share a GPU between ranks ({ranks} ranks, {gpu_count()} GPU(s))"
    parameters = parameter_count(args)
    needed = ranks * ADAM_STATE_BYTES_PER_PARAMETER * parameters if spec.base in REPLICATED else 0
    if needed > available_memory_bytes():
        return (f"model state needs {needed / 2**30:.1f} GiB ({ranks} x {ADAM_STATE_BYTES_PER_PARAMETER} B x "
                f"{parameters:,}), {available_memory_bytes() / 2**30:.1f} GiB available")
    return None


def worker_command(spec: Spec, ranks: int, output: Path, args) -> list[str]:
    """bench_worker's command line for `spec` on `ranks` ranks, writing its JSON to `output`."""
    command = [*launch.bench_worker(ranks), "--strategy", spec.base, "--json", str(output),
               "--model", args.model, "--batch-size", str(per_rank_batch(args, ranks)),
               "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--threads", str(args.threads), "--overlap", "+".join(spec.options), "--precision", spec.precision,
               "--sharding-strategy", args.sharding_strategy, "--device", args.device, "--backend", spec.backend]
    if args.vocab_size is not None:
        command += ["--vocab-size", str(args.vocab_size)]
    if args.layers is not None:
        command += ["--layers", str(args.layers)]
    return command


def per_rank_batch(args, ranks: int) -> int:
    """--batch-size per rank, or split over the ranks with --same-global-batch."""
    return args.batch_size // ranks if args.same_global_batch else args.batch_size


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def parameter_count(args) -> int:
    """The model's parameter count, built on the meta device (no memory used)."""
    import torch

    with torch.device("meta"):
        return bench_models.build(args.model, args.vocab_size, args.layers).num_parameters()


def rotated(plan: list, round_index: int) -> list:
    """The plan's order for one round: A B C, then B C A, then C A B, ..."""
    shift = round_index % len(plan)
    return plan[shift:] + plan[:shift]


def summarise(rounds: list[dict]) -> list[dict]:
    """One row per strategy from every round's runs (each round: {(spec, ranks): worker row}), with the medians,
    minima and maxima over rounds of its step and of its comparisons with the others (``compared_in_rounds``)."""
    summary = []
    for key in rounds[0]:
        runs = [each[key] for each in rounds]
        done = [row for row in runs if "step_s" in row]
        row = {field: runs[0].get(field) for field in ("strategy", "precision", "ranks")}
        if not done:
            summary.append({**row, "rounds": 0, "note": runs[0].get("note", "")})
            continue
        steps = [run["step_s"] for run in done]
        row.update({field: median_of_known(run.get(field) for run in done) for field in MEASURED},
                   rounds=len(done), step_s_min=min(steps), step_s_max=max(steps),
                   note="" if len(done) == len(runs) else f"{len(runs) - len(done)} round(s) failed: "
                                                          f"{next(r['note'] for r in runs if 'step_s' not in r)}")
        ratios, peak_ratios, beyond, efficiency = compared_in_rounds(rounds, runs)
        if ratios:
            row.update(fsdp_mpi_ratio=statistics.median(ratios), fsdp_mpi_ratio_min=min(ratios),
                       fsdp_mpi_ratio_max=max(ratios))
        if peak_ratios:
            row.update(fsdp_mpi_peak_ratio=statistics.median(peak_ratios), fsdp_mpi_peak_ratio_min=min(peak_ratios),
                       fsdp_mpi_peak_ratio_max=max(peak_ratios))
        if efficiency:
            row.update(scaling_efficiency=statistics.median(efficiency), scaling_efficiency_min=min(efficiency),
                       scaling_efficiency_max=max(efficiency))
        if beyond:
            row["beyond_plain_s"] = statistics.median(beyond)
            if row.get("mpi_blocked_s"):  # communication hidden under computation, of the time spent in it
                row["hidden_fraction"] = min(max(1 - row["beyond_plain_s"] / row["mpi_blocked_s"], 0.0), 1.0)
        summary.append(row)
    return summary


def compared_in_rounds(rounds: list[dict], runs: list[dict]) -> tuple[list, list, list, list]:
    """One strategy's `runs` (one a round) against the others of their round, in the rounds where both finished:
    fsdp-mpi's step on as many ranks at the same precision over this one's, and its step's peak resident memory
    over this one's (``fsdp_mpi_peak_ratio``); this step minus plain torch's on one rank at the same precision
    (``beyond_plain_s``); and tokens/s per rank over plain's (``scaling_efficiency``: with the same per-rank
    batch, weak scaling)."""
    ratios, peak_ratios, beyond, efficiency = [], [], [], []
    for each, run in zip(rounds, runs):
        ours = finished_run(each, "fsdp-mpi", run.get("precision"), run.get("ranks"))
        plain = finished_run(each, "plain", run.get("precision"), ranks=1)
        if "step_s" in run and ours:
            ratios.append(ours["step_s"] / run["step_s"])
            if ours.get("step_peak_rss_mb") and run.get("step_peak_rss_mb"):
                peak_ratios.append(ours["step_peak_rss_mb"] / run["step_peak_rss_mb"])
        if "step_s" in run and plain:
            beyond.append(run["step_s"] - plain["step_s"])
            efficiency.append(run["tokens_per_s"] / run["ranks"] / plain["tokens_per_s"])
    return ratios, peak_ratios, beyond, efficiency


def finished_run(runs: dict, strategy: str, precision: str, ranks: int | None = None) -> dict | None:
    """The finished run of `strategy` at `precision` (on `ranks` ranks, if given) among one round's `runs`."""
    return next((row for (_, count), row in runs.items() if row.get("strategy") == strategy
                 and row.get("precision") == precision and (ranks is None or count == ranks) and "step_s" in row),
                None)


def argument_parser() -> argparse.ArgumentParser:
    """bench.py's options; ``arguments`` reads and checks them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2-seed", choices=bench_models.NAMES)
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="default: the model's own (GPT-2's BPE, 50,257; BERT's WordPiece, 30,522)")
    parser.add_argument("--layers", type=int, default=None,
                        help="blocks (fsdp-mpi's units) in the model; default: the model's own. Many small "
                             "ones measure the wrapper's work per unit, which a GPU step waits for on the host")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=8, help="per rank")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds, each running every strategy once in a rotated order (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run (default: %(default)s)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per run (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--strategies", default="plain,fsdp-mpi@1,fsdp-mpi,torch-fsdp,ddp,lightning-ddp",
                        help="comma-separated; NAME@K runs NAME on K ranks instead of --ranks")
    parser.add_argument("--sharding-strategy", default="FULL_SHARD", choices=SHARDING_STRATEGIES,
                        help="fsdp-mpi's; HYBRID_SHARD groups by node unless FSDP_MPI_HYBRID_GROUP_SIZE is set "
                             "(default: %(default)s)")
    parser.add_argument("--malloc-as-shipped", action="store_true",
                        help="only fsdp-mpi keeps freed memory for reuse (as it does when imported); by default "
                             "every strategy runs with the same glibc setting: " + MALLOC_REUSE)
    parser.add_argument("--same-global-batch", action="store_true",
                        help="--batch-size is the global batch, split over each strategy's ranks (one process on "
                             "--batch-size against N ranks on --batch-size / N)")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cuda: each rank on the GPU of its place on its node (default: %(default)s)")
    parser.add_argument("--out", default="results/bench.csv")
    parser.add_argument("--figure", type=Path, help="where to draw each strategy's step part by part "
                                                    "(default: beside --out, *-breakdown.png)")
    return parser


def arguments(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[tuple[str, int]]]:
    """The command line, checked: (its arguments, the plan: each strategy with its rank count). Bad input exits
    with a message and status 2, before anything is launched."""
    parser = argument_parser()
    args = parser.parse_args(argv)
    if min(args.ranks, args.batch_size, args.seq_len, args.steps, args.threads, args.rounds) < 1 or args.warmup < 0:
        parser.error("--ranks, --batch-size, --seq-len, --steps, --threads and --rounds must be positive")
    if args.layers is not None and args.layers < 1:
        parser.error("--layers must be positive")
    if args.seq_len > bench_models.context_length(args.model):
        parser.error(f"--seq-len exceeds {args.model}'s context of {bench_models.context_length(args.model)}")
    try:
        plan = read_plan(args.strategies, args.ranks, args.device)
    except PlanError as error:
        parser.error(str(error))
    if args.same_global_batch and any(args.batch_size % ranks for _, ranks in plan):
        parser.error("--same-global-batch: --batch-size must divide by every strategy's rank count")
    if len(set(plan)) < len(plan):
        parser.error("a strategy is listed twice")
    return args, plan


def main() -> int:
    args, plan = arguments()
    out = Path(args.out)
    rounds_out = out.with_name(out.stem + "-rounds.csv")
    rounds, log = [], []
    for index in range(args.rounds):
        print(f"== round {index + 1} of {args.rounds}", flush=True)
        runs = {}
        for position, (name, ranks) in enumerate(rotated(plan, index)):
            runs[name, ranks] = run_one(name, ranks, args)
            log.append({"round": index + 1, "position": position + 1, **runs[name, ranks]})
            # after every run: a bench cut short (a lent GPU's time limit) keeps each run it finished
            bench_report.write_csv(rounds_out, log, ROUND_FIELDS, args)
        rounds.append({key: runs[key] for key in plan})  # the plan's order again, for the table
    rows = summarise(rounds)
    bench_report.print_settings(args)
    bench_report.print_table(rows)
    bench_report.print_breakdown(rows)
    bench_report.write_csv(out, rows, FIELDS, args)
    figure = args.figure or out.with_name(out.stem + "-breakdown.png")
    figure.parent.mkdir(parents=True, exist_ok=True)
    bench_report.plot_breakdown(rows, figure, f"{args.model}, {bench_report.batch_words(args)}, {args.rounds} rounds")
    print(f"\nwrote {out}, {rounds_out} and {figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Predicts fsdp-mpi's step time, epoch time and memory per rank from a profile of one rank's step and a network model.

    python experiments/predict.py profile --model gpt2-seed --out results/profile.json
    mpiexec -n 4 python experiments/predict.py profile --out results/profile-4.json   # under 4 ranks' load
    mpiexec -n 4 python experiments/predict.py time-comm --out results/comm-4.json
    python experiments/predict.py validate --ranks 2,3,4 --rounds 3     # predicted against measured, here
    python experiments/predict.py cluster --model gpt2-xl --nodes 1,2,4,8,16,32,64   # a GPU cluster on paper

``profile`` times one rank's step unit by unit (fsdp-mpi on one rank, so no
communication) and counts the bytes autograd saves for backward; under mpiexec
every rank profiles a model of its own, phase by phase in step with the others,
so that the profile sees the machine shared as a job of that many ranks shares
it. ``time-comm`` times fsdp-mpi's collectives over every group size the
strategies use on this many ranks, for sizes from 16 KiB to 128 MiB (a latency
and a bandwidth per size range). ``validate`` does both (each profile under as
many ranks as the layout it predicts), then measures real steps of 2-4 ranks
under FULL_SHARD, HYBRID_SHARD and NO_SHARD, interleaved in rounds, and
reports the prediction's error per round, of the step time and of the peak
resident memory per rank.
``cluster`` computes a profile from FLOPs for hardware that is not here and
prices collectives on a ring network of stated links. The model: measuring/costmodel.py
and docs/measuring.md ("Predicting a run"); the profile and the timings: measuring/profiling.py.
"""

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path

from measuring import launch
from measuring.costmodel import SHARDING_STRATEGIES, Layout, Link, RingNetwork, predict, state_bytes
from measuring.launch import mpiexec
from measuring.profiling import (SIZES, PredictError, load_network, load_profile, measure_profile,
                                 profile_from_flops, save_profile, time_collectives)

from fsdp_mpi_models.gpt2 import GPT2_CONFIGS, gpt2_config

MiB = 2**20


# ------------------------------------------------------------------ validate: predicted against measured, here


def run_checked(command: list[str], what: str) -> None:
    env = launch.environment(OMP_NUM_THREADS="1")
    finished = subprocess.run(command, env=env, capture_output=True, text=True)
    if finished.returncode != 0:
        last = (finished.stderr.strip().splitlines() or ["no output"])[-1]
        raise PredictError(f"{what} failed (exit {finished.returncode}): {last}")


def model_options(args) -> list[str]:
    return ["--model", args.model, "--vocab-size", str(args.vocab_size), "--batch-size", str(args.batch_size),
            "--seq-len", str(args.seq_len), "--steps", str(args.steps), "--warmup", str(args.warmup)]


def layouts(ranks: list[int], strategies: list[str], group_size: int):
    """(ranks, Layout) to measure: HYBRID_SHARD only where it differs from FULL_SHARD (more than one group)."""
    for count in ranks:
        for strategy in strategies:
            if strategy == "HYBRID_SHARD" and (count % group_size or count == group_size):
                continue
            yield count, Layout(strategy, nodes=1, ranks_per_node=count,
                                group_size=group_size if strategy == "HYBRID_SHARD" else None)


def validate(args) -> list[dict]:
    """Rounds of: profiles (one per rank count, under its load), then each layout measured and predicted.

    The collectives are timed once, before the rounds. Each row is
    one layout: the median over rounds of predicted / measured, with its range.
    """
    work = Path(args.out_dir) / "predict"
    work.mkdir(parents=True, exist_ok=True)
    plan = list(layouts(args.ranks, args.strategies, args.hybrid_group_size))
    networks = {}
    for count in sorted({count for count, _ in plan}):
        path = work / f"comm-{count}.json"
        print(f"-- timing collectives on {count} ranks", flush=True)
        run_checked([*mpiexec(count), sys.executable, __file__, "time-comm", "--out", str(path),
                     "--max-bytes", str(args.max_bytes), "--repeats", str(args.repeats)], f"time-comm on {count} ranks")
        networks[count] = load_network(path)
    results = {index: [] for index in range(len(plan))}
    for round_number in range(1, args.rounds + 1):
        print(f"-- round {round_number}: profiles, then {len(plan)} layouts", flush=True)
        profiles = {}
        for count in sorted({count for count, _ in plan}):  # each under the load of as many ranks as it predicts
            path = work / f"profile-{count}-round{round_number}.json"
            run_checked([*mpiexec(count), sys.executable, __file__, "profile", *model_options(args), "--out",
                         str(path)], f"the profile on {count} ranks at once")
            profiles[count] = load_profile(path)
        for index, (count, layout) in enumerate(plan):
            measured = measure_steps(args, layout, work / "step.json")
            predicted = predict(profiles[count], networks[count], layout)
            results[index].append((predicted, measured, profiles[count]))
    rows = []
    for index, (count, layout) in enumerate(plan):
        ratios = [p.step_s / m["step_s"] for p, m, _ in results[index]]
        predicted = statistics.median(p.step_s for p, _, _ in results[index])
        measured = statistics.median(m["step_s"] for _, m, _ in results[index])
        last_prediction, last_measured, profile = results[index][-1]
        rows.append({"ranks": count, "strategy": describe(layout), "predicted_step_s": predicted,
                     "measured_step_s": measured, "error_pct": 100 * (statistics.median(ratios) - 1),
                     "error_min_pct": 100 * (min(ratios) - 1), "error_max_pct": 100 * (max(ratios) - 1),
                     "predicted_comm_s": last_prediction.comm_s, "measured_mpi_s": last_measured["mpi_blocked_s"],
                     "predicted_comm_mb": last_prediction.bytes_moved / MiB,
                     "measured_comm_mb": last_measured["comm_mb_per_step"],
                     "predicted_state_mb": state_bytes(profile, layout) / MiB,
                     "measured_state_mb": last_measured["model_state_mb"],
                     "predicted_peak_mb": last_prediction.memory_bytes / MiB,
                     "measured_peak_mb": last_measured["peak_rss_mb"], "rounds": len(ratios)})
    return rows


def measure_steps(args, layout: Layout, output: Path) -> dict:
    command = [*launch.bench_worker(layout.ranks), "--strategy", "fsdp-mpi",
               *model_options(args), "--sharding-strategy", layout.strategy, "--json", str(output)]
    if layout.strategy == "HYBRID_SHARD":
        command += ["--hybrid-group-size", str(layout.shard_group)]
    run_checked(command, f"{describe(layout)} on {layout.ranks} ranks")
    return json.loads(output.read_text())


def describe(layout: Layout) -> str:
    if layout.strategy == "HYBRID_SHARD":
        return f"HYBRID_SHARD ({layout.replicas} groups of {layout.shard_group})"
    return layout.strategy


# ------------------------------------------------------------------ cluster: predictions on paper


def cluster(args) -> list[dict]:
    profile = profile_from_flops(args.model, args.batch_size, args.seq_len, args.peak_tflops * 1e12, args.mfu,
                                 args.memory_gbps * 1e9)
    network = RingNetwork(intra=Link(args.intra_latency_us * 1e-6, args.intra_gbps * 1e9),
                          inter=Link(args.inter_latency_us * 1e-6, args.inter_gbps * 1e9))
    rows = []
    for nodes in args.nodes:
        for strategy in args.strategies:
            layout = Layout(strategy, nodes=nodes, ranks_per_node=args.ranks_per_node)
            if strategy == "HYBRID_SHARD" and nodes == 1:
                continue  # one node: the same as FULL_SHARD
            for overlap in (False, True):
                prediction = predict(profile, network, layout, overlap=overlap)
                tokens_per_s = profile.tokens_per_rank * layout.ranks / prediction.step_s
                rows.append({"nodes": nodes, "gpus": layout.ranks, "strategy": strategy, "overlap": overlap,
                             "step_s": prediction.step_s, "compute_s": prediction.compute_s,
                             "comm_s": prediction.comm_s, "exposed_comm_s": prediction.exposed_comm_s,
                             "tokens_per_s": tokens_per_s, "epoch_h": args.epoch_tokens / tokens_per_s / 3600,
                             "scaling_efficiency": tokens_per_s / layout.ranks / (profile.tokens_per_rank
                                                                                  / prediction.compute_s),
                             "memory_gib": prediction.memory_bytes / 2**30,
                             "fits": prediction.memory_bytes <= args.gpu_memory_gib * 2**30})
    return rows


def plot_cluster(rows: list[dict], path: Path, title: str, gpu_memory_gib: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (speed, memory) = plt.subplots(1, 2, figsize=(11, 4))
    for strategy in dict.fromkeys(row["strategy"] for row in rows):
        for overlap, style in ((False, "--"), (True, "-")):
            mine = [row for row in rows if row["strategy"] == strategy and row["overlap"] == overlap]
            speed.plot([r["gpus"] for r in mine], [r["tokens_per_s"] for r in mine], style, marker="o",
                       label=f"{strategy}{' + overlap' if overlap else ''}")
        mine = [row for row in rows if row["strategy"] == strategy and not row["overlap"]]
        memory.plot([r["gpus"] for r in mine], [r["memory_gib"] for r in mine], marker="o", label=strategy)
    ideal = [row for row in rows if row["strategy"] == rows[0]["strategy"] and not row["overlap"]]
    speed.plot([r["gpus"] for r in ideal], [r["tokens_per_s"] / r["scaling_efficiency"] for r in ideal], ":",
               color="grey", label="computation alone")
    memory.axhline(gpu_memory_gib, color="grey", linestyle=":", label="GPU memory")
    for axes, label in ((speed, "tokens/s"), (memory, "GiB per GPU (peak)")):
        axes.set_xscale("log", base=2)
        axes.set_xlabel("GPUs")
        axes.set_ylabel(label)
        axes.legend(fontsize=8)
    speed.set_yscale("log")
    figure.suptitle(title, fontsize=10)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


# ------------------------------------------------------------------ output and command line


def write_table(rows: list[dict], stem: Path, title: str) -> None:
    """Prints the rows as a markdown table and writes STEM.csv and STEM.md."""
    def cell(value):
        return f"{value:.4g}" if isinstance(value, float) else str(value)

    columns = list(rows[0])
    lines = [f"{title}\n", "| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    print("\n".join(lines))
    stem.parent.mkdir(parents=True, exist_ok=True)
    with open(stem.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"\nwrote {stem.with_suffix('.csv')} and {stem.with_suffix('.md')}")


def comma_list(kind, choices=None):
    def parse(text: str):
        try:
            values = [kind(item) for item in text.split(",") if item.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}") from None
        if not values or (choices and not set(values) <= set(choices)):
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(map(str, choices or ()))}")
        return values
    return parse


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def model_arguments(command, model, batch_size, seq_len):
        command.add_argument("--model", default=model, choices=list(GPT2_CONFIGS))
        command.add_argument("--batch-size", type=int, default=batch_size, help="per rank (default: %(default)s)")
        command.add_argument("--seq-len", type=int, default=seq_len, help="(default: %(default)s)")

    for name in ("profile", "validate"):
        command = commands.add_parser(name)
        model_arguments(command, "gpt2-seed", 2, 64)
        command.add_argument("--vocab-size", type=int, default=50257)
        command.add_argument("--steps", type=int, default=6, help="timed steps per measurement")
        command.add_argument("--warmup", type=int, default=2)
    profile = commands.choices["profile"]
    profile.add_argument("--threads", type=int, default=1)
    profile.add_argument("--out", required=True)

    timing = commands.add_parser("time-comm", help="under mpiexec")
    timing.add_argument("--max-bytes", type=int, default=SIZES[-1])
    timing.add_argument("--repeats", type=int, default=5)
    timing.add_argument("--out", required=True)

    check = commands.choices["validate"]
    check.add_argument("--ranks", type=comma_list(int), default=[2, 3, 4])
    check.add_argument("--strategies", type=comma_list(str, SHARDING_STRATEGIES), default=list(SHARDING_STRATEGIES))
    check.add_argument("--hybrid-group-size", type=int, default=2)
    check.add_argument("--rounds", type=int, default=3)
    check.add_argument("--max-bytes", type=int, default=SIZES[-1], help="largest collective timed")
    check.add_argument("--repeats", type=int, default=5, help="timings per collective and size")
    check.add_argument("--out-dir", default="results")

    paper = commands.add_parser("cluster")
    model_arguments(paper, "gpt2-xl", 8, 1024)
    paper.add_argument("--nodes", type=comma_list(int), default=[1, 2, 4, 8, 16, 32, 64])
    paper.add_argument("--ranks-per-node", type=int, default=8)
    paper.add_argument("--strategies", type=comma_list(str, SHARDING_STRATEGIES),
                       default=["FULL_SHARD", "HYBRID_SHARD"])
    paper.add_argument("--peak-tflops", type=float, default=989.0, help="per GPU, bf16 dense (H100 SXM: 989)")
    paper.add_argument("--mfu", type=float, default=0.45, help="fraction of peak the matmuls reach")
    paper.add_argument("--gpu-memory-gib", type=float, default=80.0, help="per GPU (H100 SXM: 80)")
    paper.add_argument("--memory-gbps", type=float, default=2300.0, help="HBM bytes/s the optimizer reaches")
    paper.add_argument("--intra-gbps", type=float, default=360.0, help="NVLink bus bandwidth per GPU, GB/s")
    paper.add_argument("--intra-latency-us", type=float, default=5.0)
    paper.add_argument("--inter-gbps", type=float, default=40.0, help="network bus bandwidth per GPU, GB/s "
                       "(400 Gb/s InfiniBand: 50 GB/s on the wire)")
    paper.add_argument("--inter-latency-us", type=float, default=10.0)
    paper.add_argument("--epoch-tokens", type=float, default=9e9, help="tokens per epoch (default: OpenWebText's)")
    paper.add_argument("--out-dir", default="results")
    args = parser.parse_args()
    for name in ("batch_size", "seq_len", "steps", "rounds", "repeats", "ranks_per_node", "max_bytes"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if hasattr(args, "seq_len") and args.seq_len > gpt2_config(args.model).n_positions:
        parser.error(f"--seq-len exceeds {args.model}'s context of {gpt2_config(args.model).n_positions}")
    if min(getattr(args, "ranks", [1]) + getattr(args, "nodes", [1])) < 1:
        parser.error("rank and node counts must be positive")
    return args


def main() -> int:
    args = arguments()
    try:
        if args.command == "profile":
            from mpi4py import MPI

            profile = measure_profile(args)
            if MPI.COMM_WORLD.Get_rank() == 0:
                save_profile(profile, Path(args.out))
        elif args.command == "time-comm":
            from fsdp_mpi import Communicator

            comm = Communicator()
            curves = time_collectives(args, comm)
            if comm.rank == 0:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(curves, indent=1))
        elif args.command == "validate":
            rows = validate(args)
            write_table(rows, Path(args.out_dir) / "predict-validation",
                        f"{args.model}, batch {args.batch_size} x {args.seq_len} per rank, 1 thread per rank, "
                        f"{args.rounds} rounds; error = predicted / measured - 1 (median, min, max over rounds)")
        else:
            rows = cluster(args)
            stem = Path(args.out_dir) / f"predict-{args.model}-cluster"
            title = (f"{args.model}, {args.batch_size} x {args.seq_len} tokens per GPU, bf16-mixed, "
                     f"{args.ranks_per_node} GPUs per node at {args.mfu:.0%} of {args.peak_tflops:g} TFLOP/s; "
                     f"NVLink {args.intra_gbps:g} GB/s, network {args.inter_gbps:g} GB/s per GPU")
            write_table(rows, stem, title)
            plot_cluster(rows, stem.with_suffix(".png"), title, args.gpu_memory_gib)
    except PredictError as error:
        print(f"predict.py: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

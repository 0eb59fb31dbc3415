"""One table and one figure from bench.py runs at several link rates (hpc/cluster/network_bench.sh).

    python experiments/network_report.py results/network none 10gbit 1gbit

Reads DIR/bench-RATE.csv for each RATE (as the cluster's ``rate`` command names it; "none":
no limit) and writes DIR/network.md (per strategy and rate: the median step time over rounds
with its min and max, fsdp-mpi FULL_SHARD's step over this one's in the same round, and the bytes
each node sent to the other per step, beside the cost model's bytes for fsdp-mpi's strategies)
and DIR/network.png (step time against link rate). The runs are 2 nodes of 2 ranks.
"""

import argparse
import csv
import sys
from pathlib import Path

from measuring.bench_plan import FLAT, read_spec
from measuring.costmodel import SHARDING_STRATEGIES, Layout, Profile, Unit, step_link_bytes

from fsdp_mpi_models.gpt2 import GPT2LMHeadModel, gpt2_config

NODES, RANKS_PER_NODE = 2, 2


def gbit_per_s(rate: str) -> float | None:
    """A tc rate as Gbit/s (10gbit, 500mbit); None for no limit."""
    if rate == "none":
        return None
    units = {"gbit": 1.0, "mbit": 1e-3, "kbit": 1e-6}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return float(rate[: -len(unit)]) * scale
    raise ValueError(f"rate {rate!r}: expected NUMBERgbit, NUMBERmbit or none")


def read(directory: Path, rates: list[str]) -> dict[str, dict[str, dict]]:
    """{rate: {strategy: bench.py's summary row}}."""
    table = {}
    for rate in rates:
        path = directory / f"bench-{rate}.csv"
        if not path.exists():
            raise FileNotFoundError(f"{path} is missing: run hpc/cluster/network_bench.sh with RATES including {rate}")
        with open(path) as f:
            table[rate] = {row["strategy"]: row for row in csv.DictReader(f)}
    return table


def predicted_link_mb(strategy: str, model: str, vocab_size: int) -> float | None:
    """The cost model's bytes per node per step for an fsdp-mpi run of bench.py (fp32), else None."""
    spec = read_spec(strategy)
    flat = FLAT in spec.options  # one flat ring across the nodes (bench.py's fsdp-mpi+flat), not two levels
    sharding = [option for option in spec.options if option != FLAT]
    if spec.base != "fsdp-mpi" or len(sharding) > 1 or not set(sharding) <= set(SHARDING_STRATEGIES):
        return None
    import torch

    with torch.device("meta"):
        gpt2 = GPT2LMHeadModel(gpt2_config(model, vocab_size=vocab_size))
    blocks = gpt2.transformer.h
    block = [Unit(f"block.{i}", sum(p.numel() for p in b.parameters()), 0.0, 0.0, tensors=len(list(b.parameters())))
             for i, b in enumerate(blocks)]
    stored = sum(p.numel() for p in gpt2.parameters())  # as moved: the vocabulary's padding too
    root = Unit("<root>", stored - sum(u.numel for u in block), 0.0, 0.0, is_root=True,
                tensors=len(list(gpt2.parameters())) - sum(u.tensors for u in block))
    profile = Profile([root, *block], optimizer_s=0.0, activation_bytes=0, tokens_per_rank=0)
    layout = Layout(sharding[0] if sharding else "FULL_SHARD", NODES, RANKS_PER_NODE, two_level=not flat)
    return step_link_bytes(profile, layout) / 2**20


def number(text: str, digits: int = 3) -> str:
    return "" if text in ("", None) else f"{float(text):.{digits}g}"


def markdown(table: dict[str, dict[str, dict]], rates: list[str], vocab_size: int) -> str:
    strategies = list(dict.fromkeys(name for rows in table.values() for name in rows))
    lines = ["| strategy | predicted link MB/step | " + " | ".join(
                 f"{rate}: step s (min-max) | FULL_SHARD / this | link MB/step" for rate in rates) + " |",
             "| --- | --- |" + " --- | --- | --- |" * len(rates)]
    for name in strategies:
        any_row = next(rows[name] for rows in table.values() if name in rows)
        predicted = predicted_link_mb(name, any_row["model"], vocab_size)
        cells = ["" if predicted is None else f"{predicted:.4g}"]
        for rate in rates:
            row = table[rate].get(name, {})
            if not row.get("step_s"):
                cells += [row.get("note", "not run"), "", ""]
                continue
            cells += [f"{number(row['step_s'])} ({number(row['step_s_min'])}-{number(row['step_s_max'])})",
                      f"{number(row['fsdp_mpi_ratio'])} ({number(row['fsdp_mpi_ratio_min'])}-"
                      f"{number(row['fsdp_mpi_ratio_max'])})", number(row.get("link_mb_per_step"), 4)]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot(table: dict[str, dict[str, dict]], rates: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    limited = sorted((gbit_per_s(rate), rate) for rate in rates if gbit_per_s(rate) is not None)
    unlimited_x = 10 * max((x for x, _ in limited), default=1.0)  # "no limit" drawn one decade right of the fastest
    points = [*limited, *((unlimited_x, "none") for rate in rates if rate == "none")]
    figure, axes = plt.subplots(figsize=(6.5, 4))
    for name in dict.fromkeys(name for rows in table.values() for name in rows):
        xs, ys, low, high = [], [], [], []
        for x, rate in points:
            row = table[rate].get(name, {})
            if row.get("step_s"):
                xs.append(x)
                ys.append(float(row["step_s"]))
                low.append(float(row["step_s"]) - float(row["step_s_min"]))
                high.append(float(row["step_s_max"]) - float(row["step_s"]))
        axes.errorbar(xs, ys, yerr=[low, high], marker="o", capsize=3, label=name)
    axes.set_xscale("log")
    axes.set_xticks([x for x, _ in points], [("no limit" if rate == "none" else rate) for _, rate in points])
    axes.set_xlabel("inter-node link rate")
    axes.set_ylabel("step time, s (median, min-max)")
    axes.set_title("2 nodes x 2 ranks, one machine's network namespaces")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("rates", nargs="+", help="as given to hpc/cluster/cluster.sh rate: 10gbit, 1gbit, none")
    parser.add_argument("--vocab-size", type=int, default=50257, help="bench.py's (default: %(default)s)")
    args = parser.parse_args()
    try:
        for rate in args.rates:
            gbit_per_s(rate)
        table = read(args.directory, args.rates)
    except (ValueError, FileNotFoundError) as error:
        print(f"network_report.py: {error}", file=sys.stderr)
        return 2
    report = markdown(table, args.rates, args.vocab_size)
    (args.directory / "network.md").write_text(report)
    plot(table, args.rates, args.directory / "network.png")
    print(report + f"\nwrote {args.directory / 'network.md'} and {args.directory / 'network.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

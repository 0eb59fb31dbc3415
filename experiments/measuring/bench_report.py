"""bench.py's results as shown and kept: the summary and the step part by part as Markdown tables, a figure
of every strategy's step, and the CSV files (the summary, and every run of every round)."""

import csv
from pathlib import Path

from measuring import figures
from measuring.reported import PARTS


def print_settings(args) -> None:
    """What was measured, and how, above the tables."""
    allocator = ("fsdp-mpi reuses freed memory, the others use glibc's defaults" if args.malloc_as_shipped
                 else "every strategy reuses freed memory")
    print(f"\n{args.model}, {args.layers or 'its'} layers, vocabulary {args.vocab_size or 'its own'}, "
          f"{batch_words(args, ' tokens')}, "
          f"{args.threads} thread(s) per rank, {args.steps} timed steps after {args.warmup} warm-up per run, "
          f"{args.rounds} rounds in rotated order; allocator: {allocator}\n")


def batch_words(args, unit: str = "") -> str:
    """The batch in words: "batch 8 x 256{unit} per rank", or "global batch 8 x 256{unit}" (--same-global-batch)."""
    batch = "global batch" if args.same_global_batch else "batch"
    return f"{batch} {args.batch_size} x {args.seq_len}{unit}{'' if args.same_global_batch else ' per rank'}"


def print_table(rows: list[dict]) -> None:
    """The summary as a Markdown table: medians with (min-max) over rounds."""
    def number(value, digits=3):
        return "" if value is None else f"{value:.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"

    def spread(row, field):
        if row.get(field) is None:
            return ""
        return f"{number(row[field])} ({number(row[field + '_min'])}-{number(row[field + '_max'])})"

    columns = ["strategy", "precision", "ranks", "step s (min-max)", "fsdp-mpi / this (min-max)",
               "scaling efficiency (min-max)", "tokens/s", "MFU", "first step s", "issued s/step",
               "CPU s/step", "model state MB", "peak RSS MB", "step peak RSS MB", "fsdp-mpi / this, step peak",
               "peak GPU MB", "comm MB/step", "link MB/step", "blocked in MPI s",
               "beyond plain s", "hidden", "note"]
    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---" for _ in columns) + " |")
    for row in rows:
        cells = [row["strategy"], row["precision"], str(row["ranks"]), spread(row, "step_s"),
                 spread(row, "fsdp_mpi_ratio"), spread(row, "scaling_efficiency"), number(row.get("tokens_per_s")),
                 number(row.get("mfu")), number(row.get("first_step_s")), number(row.get("issued_s")),
                 number(row.get("cpu_s")), number(row.get("model_state_mb"), 4), number(row.get("peak_rss_mb"), 4),
                 number(row.get("step_peak_rss_mb"), 4), spread(row, "fsdp_mpi_peak_ratio"),
                 number(row.get("peak_gpu_mb"), 4), number(row.get("comm_mb_per_step"), 4),
                 number(row.get("link_mb_per_step"), 4),
                 number(row.get("mpi_blocked_s")), number(row.get("beyond_plain_s")),
                 number(row.get("hidden_fraction"), 2), row.get("note") or ""]
        print("| " + " | ".join(cells) + " |")


PART_LABELS = {"compute_s": "compute", "gradient_assembly_s": "gradient assembly", "hooks_own_s": "hooks' own work",
               "mpi_waiting_s": "MPI: waiting for the slower rank", "mpi_moving_s": "MPI: moving data"}


def step_parts(row: dict) -> dict | None:
    """A row's step in seconds per part: fsdp-mpi's as measured, plain torch's all compute; None for the rest."""
    if row.get("compute_s") is not None:
        return {part: row.get(part) or 0.0 for part in PARTS}
    if row["strategy"] == "plain" and row.get("step_s") is not None:
        return {"compute_s": row["step_s"]}
    return None


def print_breakdown(rows: list[dict]) -> None:
    """fsdp-mpi's step part by part (the slowest rank's, medians over rounds) beside plain torch's."""
    broken_down = [(row, parts) for row in rows if (parts := step_parts(row))]
    if not any(row.get("compute_s") is not None for row, _ in broken_down):
        return
    print("\nThe step part by part, seconds (the slowest rank's; medians over rounds; measuring/breakdown.py):\n")
    print("| strategy | ranks | step | " + " | ".join(PART_LABELS.values()) + " |")
    print("| --- | --- | --- | " + " | ".join("---" for _ in PARTS) + " |")
    for row, parts in broken_down:
        cells = ["" if parts.get(part) is None else f"{parts[part]:.3g}" for part in PARTS]
        print(f"| {row['strategy']} | {row['ranks']} | {row['step_s']:.3g} | " + " | ".join(cells) + " |")


def plot_breakdown(rows: list[dict], path: Path, title: str) -> None:
    """Stacked bars of each strategy's step: fsdp-mpi's parts, plain's compute, the others' step whole.
    Long strategy names are wrapped (figures.wrap) and the figure grows with their lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    measured = [row for row in rows if row.get("step_s") is not None]
    if not measured:
        return

    def label(row):
        alone = ", each alone" if row["strategy"] == "plain" and row["ranks"] > 1 else ""
        return figures.wrap(f"{row['strategy']} ({row['ranks']} rank{'s' if row['ranks'] > 1 else ''}{alone})", 30)

    labels = [label(row) for row in reversed(measured)]
    label_lines = sum(text.count("\n") + 1 for text in labels)
    figure, axes = plt.subplots(figsize=(7, 0.16 * label_lines + 0.3 * len(measured) + 2.2), layout="constrained")
    colours = dict(zip([*PARTS, "whole"], ["#4c72b0", "#dd8452", "#c44e52", "#8172b3", "#937860", "#bbbbbb"]))
    labelled = set()
    for position, row in enumerate(reversed(measured)):
        left = 0.0
        for part, seconds in (step_parts(row) or {"whole": row["step_s"]}).items():
            legend_label = None if part in labelled else PART_LABELS.get(part, "step, not broken down")
            labelled.add(part)
            axes.barh(position, seconds, left=left, color=colours[part], label=legend_label)
            left += seconds
    axes.set_yticks(range(len(measured)), labels, fontsize=8)
    axes.set_xlabel("seconds per step (median over rounds)")
    figure.suptitle(figures.wrap(title, 80), fontsize=9)  # centred on the figure, not on the narrower axes
    figure.legend(fontsize=7, loc="outside lower center", ncol=3, frameon=False)
    figures.save(figure, path, dpi=90)


def write_csv(path: Path, rows: list[dict], fields: list[str], args) -> None:
    """`rows` under `fields`, each after the settings of the run (``args``): model, batch, threads, allocator."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["model", "layers", "vocab_size", "batch_size", "global_batch",
                                               "seq_len", "threads", "malloc", *fields],
                                extrasaction="ignore")
        writer.writeheader()
        malloc = "as shipped (fsdp-mpi only)" if args.malloc_as_shipped else "reuse for all"
        for row in rows:
            writer.writerow({"model": args.model, "layers": args.layers or "its own",
                             "vocab_size": args.vocab_size or "its own", "batch_size": args.batch_size,
                             "global_batch": args.same_global_batch, "seq_len": args.seq_len,
                             "threads": args.threads, "malloc": malloc, **row})

"""Tables and plots from experiment CSVs: one line per experiment, model, strategy, precision and world size.

    python experiments/compare.py results/*.csv [--out-dir results/report]

Training CSVs (run_gpt2.py, run_bert.py) give summary.md and summary.csv (epoch
time, throughput speed-up over the same strategy on 1 rank, peak memory per
rank, model-state memory, final losses and metrics) and, one panel per
experiment, epoch_time.png and peak_memory.png (a line per strategy and precision
against the number of ranks) and loss_curves.png: training loss per optimizer step
from the runs' ``-steps.csv`` files where given (per epoch where not), validation
loss at each epoch's end. eval.py's CSVs, given among them or alone, give
evaluation.md and evaluation.csv (quality, size and speed per precision and batch
size) and evaluation.png.

A configuration run several times is one line: the median of its runs' epoch times
(each run's mean over its epochs after the first) with their min and max. Runs whose
ids end in ``-r<N>`` are round N of an interleaved comparison (every strategy once
per round, as ``hpc/gpu_check.sh seed-report`` names them): each line then also gets
fsdp_mpi_ratio, fsdp-mpi's epoch time over this line's in the same round, on as
many ranks at the same precision (below 1: fsdp-mpi is faster), as the median of the
rounds' ratios with their min and max, the measure bench.py reports too.
"""

import argparse
import re
import sys
from pathlib import Path

import pandas as pd

from measuring import figures
from training.results import COLUMNS, EVAL_COLUMNS, STEP_COLUMNS

GROUP = ["experiment", "model", "device", "strategy", "precision", "world_size"]  # a CPU run never averages with a GPU one
EVAL_SHOWN = ["run_id", "model", "world_size", "precision", "batch_size", "size_mb", "val_loss", "val_perplexity",
              "val_mlm_accuracy", "val_nsp_accuracy", "latency_p50_ms", "latency_p99_ms", "tokens_per_s"]


# training columns newer than some CSVs, with the value those runs had
ADDED_LATER = {"cpu_offload": False, "step_in_backward": False}
# a run with one of these on is its own line beside the same strategy's, named with the suffix
OWN_LINE = {"cpu_offload": "+offload", "step_in_backward": "+step_in_backward"}


class CompareError(Exception):
    pass


def kind_of(frame: pd.DataFrame) -> tuple[str, list[str]]:
    """Which results CSV a frame is read from, by a column only that kind has, and that kind's columns."""
    if "latency_p50_ms" in frame.columns:
        return "evaluation", EVAL_COLUMNS
    if "step" in frame.columns and "epoch_time_s" not in frame.columns:
        return "steps", STEP_COLUMNS
    return "training", COLUMNS


def load(paths: list[str]) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(training rows per epoch, per optimizer step, evaluation rows) of the given CSVs, each file one kind."""
    frames = {"training": [], "steps": [], "evaluation": []}
    for path in paths:
        if not Path(path).is_file():
            raise CompareError(f"{path}: no such file")
        try:
            frame = pd.read_csv(path)
        except (pd.errors.EmptyDataError, pd.errors.ParserError, UnicodeDecodeError) as error:
            raise CompareError(f"{path}: not a results CSV ({error})") from error
        kind, columns = kind_of(frame)
        for column, default in ADDED_LATER.items():  # CSVs written before the column existed
            if kind == "training" and column not in frame.columns:
                frame[column] = default
        missing = [c for c in columns if c not in frame.columns]
        if missing:
            raise CompareError(f"{path}: not a results CSV (missing columns {', '.join(missing)})")
        if kind == "training":
            for column, suffix in OWN_LINE.items():
                frame["strategy"] = frame["strategy"].where(~frame[column].astype(bool), frame["strategy"] + suffix)
        frames[kind].append(frame)
    training, steps, evaluation = (pd.concat(frames[kind], ignore_index=True) if frames[kind] else pd.DataFrame()
                                   for kind in ("training", "steps", "evaluation"))
    if training.empty and evaluation.empty:
        raise CompareError("no result rows in the given files" + (" (step CSVs need their runs' epoch CSVs beside "
                                                                  "them)" if not steps.empty else ""))
    return training, steps, evaluation


ROUND = re.compile(r"-r(\d+)$")  # a run id's ending that names its round of an interleaved comparison
BASELINE = "fsdp-mpi"  # the strategy every other is compared with, round by round


def summarize(rows: pd.DataFrame) -> pd.DataFrame:
    """One line per group. A run's epoch time is its mean over the epochs after the first (where it has several);
    a group's is the median over its runs, with their min and max; fsdp_mpi_ratio as the module says."""
    steady = rows[(rows["epoch"] > 0) | (rows.groupby("run_id")["epoch"].transform("max") == 0)]
    per_run = steady.groupby(GROUP + ["run_id"], as_index=False)[
        ["epoch_time_s", "samples_per_s", "tflops", "mfu", "comm_mb_per_step"]].mean()
    per_run["round"] = per_run["run_id"].map(lambda run_id: int(m[1]) if (m := ROUND.search(run_id)) else None)
    ratios = round_ratios(per_run)
    lines = []
    for key, group in rows.groupby(GROUP, sort=True):
        last = group.sort_values(["run_id", "epoch"]).groupby("run_id").tail(1)
        runs = per_run[per_run["run_id"].isin(group["run_id"].unique())]
        ratio = ratios.get(key, pd.Series(dtype=float))
        lines.append({
            **dict(zip(GROUP, key)), "runs": len(runs), "parameters": int(group["parameters"].iloc[0]),
            "epoch_time_s": runs["epoch_time_s"].median(), "epoch_time_min": runs["epoch_time_s"].min(),
            "epoch_time_max": runs["epoch_time_s"].max(), "samples_per_s": runs["samples_per_s"].median(),
            "fsdp_mpi_ratio": ratio.median(), "fsdp_mpi_ratio_min": ratio.min(), "fsdp_mpi_ratio_max": ratio.max(),
            "tflops": runs["tflops"].median(), "mfu": runs["mfu"].median(),
            "comm_mb_per_step": runs["comm_mb_per_step"].median(),
            "peak_memory_mb": group["peak_memory_mb"].max(), "model_state_mb": group["model_state_mb"].max(),
            "final_train_loss": last["train_loss"].mean(), "final_val_loss": last["val_loss"].mean(),
            "val_perplexity": last["val_perplexity"].mean(), "val_mlm_accuracy": last["val_mlm_accuracy"].mean(),
            "val_nsp_accuracy": last["val_nsp_accuracy"].mean(),
        })
    table = pd.DataFrame(lines)
    if (table["runs"] == 1).all():  # one run each: its time has no spread to show
        table = table.drop(columns=["epoch_time_min", "epoch_time_max"])
    one_rank = table[table["world_size"] == 1].set_index(GROUP[:-1])["samples_per_s"]
    table["speedup_vs_1_rank"] = [
        row.samples_per_s / one_rank.get((row.experiment, row.model, row.device, row.strategy, row.precision),
                                         float("nan"))
        for row in table.itertuples()
    ]
    return table.dropna(axis=1, how="all")


def round_ratios(per_run: pd.DataFrame) -> dict[tuple, pd.Series]:
    """For each group, fsdp-mpi's epoch time over the group's in each round both ran (runs with a round only)."""
    rounds = per_run.dropna(subset=["round"])
    same = [column for column in GROUP if column != "strategy"] + ["round"]
    ours = rounds[rounds["strategy"] == BASELINE].set_index(same)["epoch_time_s"]
    ratios = {}
    for key, group in rounds.groupby(GROUP):
        theirs = group.set_index(same)["epoch_time_s"]
        paired = ours.reindex(theirs.index).dropna()
        if len(paired):
            ratios[key] = (paired / theirs.loc[paired.index]).reset_index(drop=True)
    return ratios


def markdown(table: pd.DataFrame) -> str:
    """A GitHub-flavoured markdown table (numbers rounded for reading)."""
    def cell(value):
        if isinstance(value, float):
            return "" if pd.isna(value) else f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.4g}"
        return str(value)

    header = "| " + " | ".join(table.columns) + " |"
    rule = "| " + " | ".join("---" for _ in table.columns) + " |"
    body = ["| " + " | ".join(cell(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join([header, rule, *body]) + "\n"


def plot_scaling(table: pd.DataFrame, out_dir: Path) -> list[Path]:
    """epoch_time.png and peak_memory.png: a panel per experiment, a line per strategy and precision against ranks
    (epoch time with bars from its runs' min to max where a configuration ran several times)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for column, title, file_name in (("epoch_time_s", "epoch time (s), median of runs", "epoch_time.png"),
                                     ("peak_memory_mb", "peak memory per rank (MB)", "peak_memory.png")):
        experiments = sorted(table["experiment"].unique())
        figure, axes = plt.subplots(1, len(experiments), figsize=(8 * len(experiments), 4.5), squeeze=False,
                                    layout="constrained")
        for axis, experiment in zip(axes[0], experiments):  # one panel per experiment: a line per strategy
            for (model, device, strategy, precision), runs in table[table["experiment"] == experiment].groupby(
                    ["model", "device", "strategy", "precision"]):
                runs = runs.sort_values("world_size")
                spread = None
                if column == "epoch_time_s" and "epoch_time_min" in runs:
                    spread = [runs[column] - runs["epoch_time_min"], runs["epoch_time_max"] - runs[column]]
                axis.errorbar(runs["world_size"], runs[column], yerr=spread, marker="o", capsize=3,
                              label=f"{strategy} {precision} on {device} ({model})")
            axis.set_title(f"{experiment}: {title}")
            axis.set_xlabel("ranks")
            axis.set_xticks(sorted(table.loc[table["experiment"] == experiment, "world_size"].unique()))
            axis.set_ylim(bottom=0)
            legend_beside(axis)
        fit_legends(figure)
        written.append(figures.save(figure, out_dir / file_name, dpi=120))
    return written


LEGEND_WIDTH = 34  # characters per line of a legend entry beside a panel


def legend_beside(axis) -> None:
    """The panel's legend to its right, long labels (a strategy with its switches) wrapped."""
    handles, labels = axis.get_legend_handles_labels()
    axis.legend(handles, [figures.wrap(label, LEGEND_WIDTH) for label in labels], fontsize=7,
                loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)


def fit_legends(figure) -> None:
    """Makes the figure tall enough for its longest legend (7-point lines), so that none runs off its foot."""
    lines = max((sum(text.get_text().count("\n") + 1 for text in axis.get_legend().get_texts())
                 for axis in figure.axes if axis.get_legend()), default=0)
    width, height = figure.get_size_inches()
    figure.set_size_inches(width, max(height, 0.17 * lines + 1.0))


def plot_losses(rows: pd.DataFrame, steps: pd.DataFrame, out_dir: Path) -> Path:
    """loss_curves.png: a panel per experiment, a colour per run; training loss per optimizer step where the
    run's step CSV was given (else per epoch), validation loss (crosses) at each epoch's last step. A configuration
    run several times (rounds) is drawn once, from its first run: its repeats would overlay it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    stepped = set(steps["run_id"]) if not steps.empty else set()
    rows = rows[rows["run_id"].isin(rows.groupby(GROUP)["run_id"].min())]
    experiments = sorted(rows["experiment"].unique())
    figure, axes = plt.subplots(1, len(experiments), figsize=(8 * len(experiments), 4.5), squeeze=False,
                                layout="constrained")
    for axis, experiment in zip(axes[0], experiments):
        runs = rows[rows["experiment"] == experiment]
        per_step = runs["run_id"].isin(stepped).any()
        for run_id, run in runs.groupby("run_id"):
            run = run.sort_values("epoch")
            label = (f"{run['strategy'].iloc[0]} {run['precision'].iloc[0]} n={run['world_size'].iloc[0]} "
                     f"on {run['device'].iloc[0]}")
            epoch_ends = run["steps"].cumsum() if per_step else run["epoch"]
            if run_id in stepped:
                curve = steps[steps["run_id"] == run_id].sort_values("step")
                line, = axis.plot(curve["step"], curve["train_loss"], linewidth=0.8, label=f"{label} train")
            else:
                line, = axis.plot(epoch_ends, run["train_loss"], marker="o", label=f"{label} train (per epoch)")
            axis.plot(epoch_ends, run["val_loss"], marker="x", linestyle="--", color=line.get_color(),
                      label=f"{label} val")
        axis.set_title(f"{experiment}: loss per {'optimizer step' if per_step else 'epoch'}")
        axis.set_xlabel("optimizer step" if per_step else "epoch")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True))
        legend_beside(axis)
    fit_legends(figure)
    return figures.save(figure, out_dir / "loss_curves.png", dpi=120)


def plot_evaluation(rows: pd.DataFrame, out_dir: Path) -> Path:
    """Size and throughput at the largest batch, per precision, one group of bars per evaluated run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    largest = rows[rows["batch_size"] == rows.groupby("run_id")["batch_size"].transform("max")]
    figure, axes = plt.subplots(1, 2, figsize=(11, 5), layout="constrained")
    for axis, column, title in ((axes[0], "size_mb", "Weights (MiB)"), (axes[1], "tokens_per_s", "Tokens/s, largest batch")):
        table = largest.pivot_table(index=["run_id", "world_size"], columns="precision", values=column)
        table.plot.bar(ax=axis, rot=0, fontsize=7)
        axis.set_xticks(range(len(table)), [figures.wrap(f"{run_id}, {ranks} ranks", 22, joints="+,- ")
                                            for run_id, ranks in table.index], fontsize=7)  # a run id: at its dashes
        axis.set_title(title)
        axis.set_xlabel("")
    return figures.save(figure, out_dir / "evaluation.png", dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+", help="CSV files written by run_gpt2.py / run_bert.py / eval.py")
    parser.add_argument("--out-dir", default="results/report")
    args = parser.parse_args()
    try:
        training, steps, evaluation = load(args.csv)
    except CompareError as error:
        print(f"{parser.prog}: error: {error}", file=sys.stderr)
        return 2
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    if not training.empty:
        table = summarize(training)
        text = markdown(table)
        (out_dir / "summary.md").write_text(text)
        table.to_csv(out_dir / "summary.csv", index=False)
        print(text)
        written += [out_dir / "summary.md", out_dir / "summary.csv", *plot_scaling(table, out_dir),
                    plot_losses(training, steps, out_dir)]
    if not evaluation.empty:
        table = evaluation[EVAL_SHOWN].dropna(axis=1, how="all")
        text = markdown(table)
        (out_dir / "evaluation.md").write_text(text)
        evaluation.to_csv(out_dir / "evaluation.csv", index=False)
        print(text)
        written += [out_dir / "evaluation.md", out_dir / "evaluation.csv", plot_evaluation(evaluation, out_dir)]
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""bench.py runs the strategies side by side and reports ratios; oversized baselines are refused, not started."""

import csv
import json
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest

from mpi_launch import REPO_ROOT, check_ok, child_env, experiments_launcher, mpiexec, python_command, run_mpi

pytestmark = pytest.mark.one_mpi  # the benchmark's harness, not the MPI library

BENCH = REPO_ROOT / "experiments" / "bench.py"
BENCH_COMM = REPO_ROOT / "experiments" / "bench_comm.py"


def run_bench(*args, timeout=300):
    """bench.py with `args`; the ranks it launches start warm (mpi_launch.experiments_launcher)."""
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=timeout,
                          env=child_env(FSDP_MPI_MPIEXEC=experiments_launcher()))


def test_bench_rounds_ratios_and_bytes(tmp_path):
    out = tmp_path / "bench.csv"
    # the optimizer stepped inside backward (fsdp-mpi+...+step_in_backward) and FSDP2 offloaded: their paths run
    plan = ["plain", "plain@2", "fsdp-mpi@1", "fsdp-mpi", "ddp", "torch-fsdp",
            "fsdp-mpi+forward_prefetch+step_in_backward:bf16-mixed", "torch-fsdp+offload+backend=fsdp_mpi"]
    # The heap as each strategy ships it (no GLIBC_TUNABLES for the launches, whose ranks then start warm: the
    # BERT test below runs the default, every strategy with fsdp-mpi's heap setting).
    result = run_bench("--model", "gpt2-tiny", "--vocab-size", "128", "--batch-size", "2", "--seq-len", "16",
                       "--steps", "2", "--warmup", "1", "--rounds", "2", "--out", str(out), "--malloc-as-shipped",
                       "--strategies", ",".join(plan), timeout=600)  # 16 launches: past 300 s on a GPU image
    check_ok(result)
    assert "| strategy | precision | ranks | step s (min-max) | fsdp-mpi / this (min-max) |" in result.stdout
    assert "fsdp-mpi reuses freed memory, the others use glibc's defaults" in result.stdout
    with open(out) as f:
        summary = {(r["strategy"], r["precision"], r["ranks"]): r for r in csv.DictReader(f)}
    assert {row["malloc"] for row in summary.values()} == {"as shipped (fsdp-mpi only)"}
    with open(tmp_path / "bench-rounds.csv") as f:
        runs = list(csv.DictReader(f))
    # every strategy ran once per round, the second round's order rotated by one
    names = [("plain", "1"), ("plain", "2"), ("fsdp-mpi", "1"), ("fsdp-mpi", "2"), ("ddp", "2"), ("torch-fsdp", "2"),
             ("fsdp-mpi+forward_prefetch+step_in_backward", "2"), ("torch-fsdp+offload+backend=fsdp_mpi", "2")]
    order = [(r["strategy"], r["ranks"]) for r in sorted(runs, key=lambda r: (int(r["round"]), int(r["position"])))]
    assert order == names + names[1:] + names[:1]
    assert all(row["note"] == "" and int(row["rounds"]) == 2 for row in summary.values())
    ours, plain = summary["fsdp-mpi", "32", "2"], summary["plain", "32", "1"]
    # a ratio is fsdp-mpi's step over this strategy's in the same round, on as many ranks at the same precision
    assert float(ours["fsdp_mpi_ratio"]) == float(ours["fsdp_mpi_ratio_min"]) == 1.0
    assert float(plain["beyond_plain_s"]) == 0.0
    bf16 = summary["fsdp-mpi+forward_prefetch+step_in_backward", "bf16-mixed", "2"]
    assert bf16["fsdp_mpi_ratio"] == bf16["beyond_plain_s"] == ""  # neither fsdp-mpi nor plain ran in bf16
    for row in summary.values():
        assert float(row["step_s_min"]) <= float(row["step_s"]) <= float(row["step_s_max"])
        assert float(row["cpu_s"]) > 0 and float(row["tokens_per_s"]) > 0 and float(row["first_step_s"]) > 0
        # on a CPU a step is issued when it ends (on a GPU, before the GPU has run it)
        assert float(row["step_s"]) - 1e-3 <= float(row["issued_s"]) <= float(row["step_s"])
        if row is not bf16:
            assert float(row["fsdp_mpi_ratio_min"]) <= float(row["fsdp_mpi_ratio"]) <= float(row["fsdp_mpi_ratio_max"])
    step = {(r["round"], r["strategy"], r["ranks"]): float(r["step_s"]) for r in runs}
    ratios = sorted(step[k, "fsdp-mpi", "1"] / step[k, "plain", "1"] for k in ("1", "2"))
    assert float(plain["fsdp_mpi_ratio_min"]) == ratios[0] and float(plain["fsdp_mpi_ratio_max"]) == ratios[1]
    # scaling efficiency: tokens/s per rank over plain torch's on one rank, in the same round (weak scaling here)
    tokens = {(r["round"], r["strategy"], r["ranks"]): float(r["tokens_per_s"]) for r in runs}
    for strategy, ranks in (("plain", "2"), ("fsdp-mpi", "2"), ("ddp", "2")):
        efficiency = sorted(tokens[k, strategy, ranks] / 2 / tokens[k, "plain", "1"] for k in ("1", "2"))
        row = summary[strategy, "32", ranks]
        assert (float(row["scaling_efficiency_min"]), float(row["scaling_efficiency_max"])) == tuple(efficiency)
    assert float(plain["scaling_efficiency"]) == 1.0
    # A step's peak: the high-water mark over the timed steps, at most the process's whole peak; fsdp-mpi's over
    # this strategy's in the same round, as the step ratio is (bf16: no fsdp-mpi at that precision ran).
    peak = {(r["round"], r["strategy"], r["ranks"]): float(r["step_peak_rss_mb"]) for r in runs}
    for row in runs:
        assert 0 < float(row["step_peak_rss_mb"]) <= float(row["peak_rss_mb"])
    assert float(ours["fsdp_mpi_peak_ratio"]) == 1.0
    assert bf16["fsdp_mpi_peak_ratio"] == ""
    fsdp2 = summary["torch-fsdp", "32", "2"]
    peak_ratios = sorted(peak[k, "fsdp-mpi", "2"] / peak[k, "torch-fsdp", "2"] for k in ("1", "2"))
    assert (float(fsdp2["fsdp_mpi_peak_ratio_min"]), float(fsdp2["fsdp_mpi_peak_ratio_max"])) == tuple(peak_ratios)
    assert "| step peak RSS MB | fsdp-mpi / this, step peak |" in result.stdout
    # fsdp-mpi's step part by part (measuring/breakdown.py): on 2 ranks every part measured, MPI's two parts
    # no more than the time it was blocked in MPI (a median over ranks), parts of one rank: none on 1 rank
    for parts in rounds_of("fsdp-mpi", "2", runs):
        assert float(parts["gradient_assembly_s"]) > 0 and float(parts["mpi_moving_s"]) > 0
        assert 0 <= float(parts["mpi_waiting_s"]) and float(parts["hooks_own_s"]) >= 0
    for parts in rounds_of("fsdp-mpi", "1", runs):
        assert float(parts["mpi_waiting_s"]) == float(parts["mpi_moving_s"]) == 0
    assert all(row["compute_s"] == "" for row in runs if row["strategy"] in ("plain", "ddp", "torch-fsdp"))
    assert "| fsdp-mpi | 2 |" in result.stdout.split("The step part by part")[1]
    assert (tmp_path / "bench-breakdown.png").stat().st_size > 1000
    # Bytes per step: gpt2-tiny with 128 tokens has P = 112,384 parameters, B = 99,968 of them in its 2 blocks;
    # the root is gathered once and each block twice (P + B elements), every gradient reduced once in fp32 (P).
    megabytes = {"32": (4 * (112_384 + 99_968) + 4 * 112_384) / 2**20,
                 "bf16-mixed": (2 * (112_384 + 99_968) + 4 * 112_384) / 2**20}
    # fsdp-mpi adds a 4-byte flag per parameter tensor (28 here): which got a gradient on some rank.
    flags = 4 * 28 / 2**20
    assert float(ours["comm_mb_per_step"]) == pytest.approx(megabytes["32"] + flags, rel=1e-9)
    assert float(bf16["comm_mb_per_step"]) == pytest.approx(megabytes["bf16-mixed"] + flags, rel=1e-9)
    # DDP all-reduces every gradient; FSDP2 moves what fsdp-mpi does, its padding (each parameter's first
    # dimension to a multiple of 2 ranks) aside: gpt2-tiny's dimensions are even, so none.
    assert float(summary["ddp", "32", "2"]["comm_mb_per_step"]) == pytest.approx(4 * 112_384 / 2**20, rel=1e-9)
    assert float(summary["torch-fsdp", "32", "2"]["comm_mb_per_step"]) == pytest.approx(megabytes["32"], rel=1e-9)
    # the same FSDP2 over fsdp_mpi's backend (fsdp_mpi/distributed/), offloaded, makes the same calls
    over_ours = summary["torch-fsdp+offload+backend=fsdp_mpi", "32", "2"]
    assert float(over_ours["comm_mb_per_step"]) == pytest.approx(megabytes["32"], rel=1e-9)
    # sharding halves what each rank holds for parameters, gradients and Adam state (up to padding)
    assert 0.5 <= float(ours["model_state_mb"]) / float(summary["ddp", "32", "2"]["model_state_mb"]) < 0.51


def rounds_of(strategy: str, ranks: str, runs: list[dict]) -> list[dict]:
    return [row for row in runs if (row["strategy"], row["ranks"]) == (strategy, ranks)]


def test_bert_is_benchmarked_with_its_masked_lm_head_on_the_masked_tokens_only(tmp_path):
    out = tmp_path / "bench.csv"
    result = run_bench("--model", "bert-tiny", "--vocab-size", "100", "--layers", "3", "--batch-size", "2",
                       "--seq-len", "16", "--steps", "1", "--warmup", "1", "--rounds", "1", "--out", str(out),
                       "--strategies", "plain,fsdp-mpi@1")
    assert result.returncode == 0, result.stderr
    with open(out) as f:
        rows = {row["strategy"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"plain", "fsdp-mpi"} and all(row["note"] == "" for row in rows.values())
    assert {row["malloc"] for row in rows.values()} == {"reuse for all"}  # bench.py's default heap setting
    assert all((row["layers"], row["vocab_size"]) == ("3", "100") for row in rows.values())
    # FLOPs per token: 6 per weight, attention's 12 L H T, less the masked-LM head (transform and vocabulary)
    # on the 85% of tokens that are not masked (bert-tiny of 3 layers, --layers, instead of 2, of width 128)
    import torch
    from measuring.bench_models import build

    with torch.device("meta"):
        model = build("bert-tiny", 100, layers=3)
    width, layers, positions = 128, 3, 512
    head = 6 * 0.85 * (width + 100) * width
    flops = 6 * (model.num_parameters() - positions * width) + 12 * layers * width * 16 - head
    for row in rows.values():
        assert float(row["tflops"]) == pytest.approx(float(row["tokens_per_s"]) * flops / 1e12, rel=1e-3)


def test_replicated_model_too_big_for_this_machine_is_reported_not_run(tmp_path):
    result = run_bench("--model", "gpt2-xl", "--ranks", "64", "--strategies", "ddp", "--out", str(tmp_path / "b.csv"))
    check_ok(result)
    assert "not run: model state needs" in result.stdout and "x 16 B x 1,557,611,200" in result.stdout


BAD_ARGUMENTS = [  # each refused before anything is launched
    (["--strategies", "horovod"], "unknown strategy 'horovod'"),
    (["--strategies", "ddp+compile"], "unknown strategy 'ddp+compile'"),  # plain, fsdp-mpi and torch-fsdp only
    (["--strategies", "plain+compile+compile_whole"], "unknown strategy 'plain+compile+compile_whole'"),  # not both
    (["--strategies", "ddp+comm=int8"], "unknown strategy 'ddp+comm=int8'"),
    (["--strategies", "ddp+offload"], "unknown strategy 'ddp+offload'"),  # fsdp-mpi's and FSDP2's only
    (["--strategies", "ddp+step_in_backward"], "unknown strategy 'ddp+step_in_backward'"),
    (["--strategies", "fsdp-mpi+sync_copies"], "'fsdp-mpi+sync_copies': sync_copies changes the copies of an offloaded"),
    (["--strategies", "fsdp-mpi+step_in_backward:16-mixed"], "step_in_backward trains in 32 or bf16-mixed"),
    (["--strategies", "fsdp-mpi+comm=int4"], "each one of none, bf16, int8"),
    (["--strategies", "ddp@x"], "the rank count after @ must be a number"),
    (["--strategies", "ddp:fp8"], "the precision after : must be one of"),
    (["--strategies", "ddp,ddp@2"], "listed twice"),
    (["--strategies", "ddp+NO_SHARD"], "unknown strategy 'ddp+NO_SHARD'"),  # fsdp-mpi's only
    (["--strategies", "fsdp-mpi+backend=fsdp_mpi"], "unknown strategy 'fsdp-mpi+backend=fsdp_mpi'"),  # torch's only
    (["--strategies", "ddp+backend=mpi"], "unknown strategy 'ddp+backend=mpi'"),
    (["--strategies", "ddp+backend=gloo+backend=fsdp_mpi"], "unknown strategy 'ddp+backend=gloo+backend=fsdp_mpi'"),
    (["--strategies", "fsdp-mpi+NO_SHARD+HYBRID_SHARD"], "unknown strategy 'fsdp-mpi+NO_SHARD+HYBRID_SHARD'"),
    (["--strategies", "lightning-ddp+sample_dropout"], "unknown strategy 'lightning-ddp+sample_dropout'"),
    (["--rounds", "0"], "--rounds must be positive"),
    (["--layers", "0"], "--layers must be positive"),
    (["--model", "gpt2-tiny", "--seq-len", "999"], "exceeds gpt2-tiny's context"),
]


def test_bad_arguments_are_refused_with_their_reason(capsys):
    """The checks in-process (bench.arguments), then one through the script: its exit status and message."""
    import bench
    for argv, message in BAD_ARGUMENTS:
        with pytest.raises(SystemExit) as refused:
            bench.arguments(argv)
        assert refused.value.code == 2 and message in capsys.readouterr().err, argv
    assert bench.arguments(["--strategies", "plain,fsdp-mpi@3"])[1] == [("plain", 1), ("fsdp-mpi", 3)]
    assert bench.arguments(["--strategies", "fsdp-mpi+flat,fsdp-mpi+mpi+flat"])[1] == [("fsdp-mpi+flat", 2),
                                                                                       ("fsdp-mpi+mpi+flat", 2)]
    assert bench.arguments(["--strategies", "fsdp-mpi+offload:bf16-mixed"])[1] == [("fsdp-mpi+offload:bf16-mixed", 2)]
    assert bench.arguments(["--strategies", "fsdp-mpi+offload+step_in_backward"])[1] == [
        ("fsdp-mpi+offload+step_in_backward", 2)]
    assert [name for name, _ in bench.arguments(["--strategies", "plain+sample_dropout,ddp+sample_dropout"])[1]] == [
        "plain+sample_dropout", "ddp+sample_dropout"]
    assert bench.arguments(["--strategies", "torch-fsdp+compile_whole+backend=fsdp_mpi:bf16-mixed@1"])[1] == [
        ("torch-fsdp+compile_whole+backend=fsdp_mpi:bf16-mixed", 1)]
    result = run_bench("--strategies", "horovod")
    assert result.returncode == 2 and "unknown strategy 'horovod'" in result.stderr and "Traceback" not in result.stderr


def test_flat_through_mpi_and_backend_set_their_variables_and_arguments_for_the_run(monkeypatch):
    """fsdp-mpi+flat runs with FSDP_MPI_TWO_LEVEL=0 (groups spanning nodes in one flat ring), +mpi with
    FSDP_MPI_NODE_TRANSPORT=0, +offload+sync_copies with FSDP_MPI_OFFLOAD_STREAMS=0; a plain fsdp-mpi run with
    none. ddp+backend=fsdp_mpi passes the worker ``--backend fsdp_mpi`` and nothing else of its own; plain ddp
    ``--backend auto``."""
    import bench
    launched = []
    monkeypatch.setattr(bench.subprocess, "run", lambda command, env, **_: launched.append((command, env)) or
                        subprocess.CompletedProcess(command, 1, "", "stopped here"))
    args = bench.arguments(["--strategies", "fsdp-mpi"])[0]
    for spec in ("fsdp-mpi", "fsdp-mpi+flat", "fsdp-mpi+mpi", "fsdp-mpi+offload+sync_copies", "ddp+backend=fsdp_mpi",
                 "ddp"):
        bench.run_one(spec, 4, args)
    names = ("FSDP_MPI_TWO_LEVEL", "FSDP_MPI_NODE_TRANSPORT", "FSDP_MPI_OFFLOAD_STREAMS")
    settings = [tuple(env.get(name) for name in names) for _, env in launched]
    assert settings[:4] == [(None, None, None), ("0", None, None), (None, "0", None), (None, None, "0")]
    worker_options = [dict(zip(command[command.index("--strategy")::2], command[command.index("--strategy") + 1::2]))
                      for command, _ in launched[4:]]
    assert [(options["--strategy"], options["--backend"], options["--overlap"]) for options in worker_options] == \
        [("ddp", "fsdp_mpi", ""), ("ddp", "auto", "")]


def test_the_launchers_start_no_mpi():
    """bench.py (and predict.py, network_report.py, compare.py) start no rank of their own: they launch ranks or
    read results. Importing MPI would start it in them, a one-rank job of their own, where some clusters' MPI
    expects every MPI process to come from its launcher: checking a plan, compressed options included, must not."""
    check = ("import sys, bench, compare, network_report, predict\n"
             "bench.arguments(['--strategies', 'plain,fsdp-mpi+comm=int8/bf16:bf16-mixed'])\n"
             "print(sorted(name for name in ('mpi4py.MPI', 'fsdp_mpi') if name in sys.modules))")
    result = subprocess.run([sys.executable, "-c", check], cwd=REPO_ROOT / "experiments", env=child_env(),
                            capture_output=True, text=True, timeout=120)
    check_ok(result)
    assert result.stdout.strip() == "[]"


def test_the_launchers_sharding_strategies_are_fsdp_mpis():
    """bench.py and predict.py read fsdp_mpi's sharding strategies from measuring/costmodel.py, without importing
    fsdp_mpi: the copy names the same members, in the same order."""
    from measuring.costmodel import SHARDING_STRATEGIES

    from fsdp_mpi import ShardingStrategy

    assert SHARDING_STRATEGIES == tuple(ShardingStrategy.__members__)


def test_bench_comm_times_four_paths_per_size_and_operation(tmp_path):
    out = tmp_path / "comm.csv"
    command = [mpiexec(), "-n", "2", *python_command(BENCH_COMM), "--sizes-mb", "0.0625,0.25", "--rounds", "2",
               "--repeats", "1", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    check_ok(result)
    assert "| operation | MiB | fsdp-mpi GB/s | fsdp-mpi+mpi GB/s | mpi4py GB/s | gloo GB/s |" in result.stdout
    assert "fsdp-mpi: the 2 ranks of this node exchange through a host segment" in result.stdout
    assert "fsdp-mpi+mpi: host buffers go to MPI; not through shared memory: FSDP_MPI_NODE_TRANSPORT=0" in result.stdout
    with open(out) as f:
        rows = list(csv.DictReader(f))
    assert [(row["operation"], float(row["size_mb"])) for row in rows] == [
        ("all_gather", 0.0625), ("reduce_scatter", 0.0625), ("all_gather", 0.25), ("reduce_scatter", 0.25)]
    for row in rows:
        assert row["ranks"] == "2" and row["rounds"] == "2"
        for other in ("fsdp-mpi+mpi", "mpi4py", "gloo"):
            assert float(row[f"vs_{other}_min"]) <= float(row[f"vs_{other}"]) <= float(row[f"vs_{other}_max"])
            assert all(float(row[f"{path}_gb_per_s"]) > 0 for path in ("fsdp-mpi", "mpi4py", "gloo"))


def test_bench_comm_refuses_one_rank_and_bad_sizes():
    def run(ranks, *args):
        command = [mpiexec(), "-n", str(ranks), *python_command(BENCH_COMM), *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    alone = run(1)
    assert alone.returncode == 2 and "run it as mpiexec -n 2" in alone.stderr
    bad = run(2, "--sizes-mb", "x")
    assert bad.returncode != 0 and "is not a comma-separated list of numbers" in bad.stderr


def test_network_report_tables_step_times_and_the_cost_models_link_bytes(tmp_path):
    """experiments/network_report.py on bench.py summaries of two link rates (written here, not measured)."""
    from measuring.costmodel import Layout, Profile, Unit, step_link_bytes

    fields = ["model", "strategy", "step_s", "step_s_min", "step_s_max", "fsdp_mpi_ratio", "fsdp_mpi_ratio_min",
              "fsdp_mpi_ratio_max", "link_mb_per_step", "note"]
    for rate, step in (("none", 1.0), ("1gbit", 4.0)):
        with open(tmp_path / f"bench-{rate}.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields)
            writer.writeheader()
            for strategy, scale in (("fsdp-mpi", 1.0), ("fsdp-mpi+HYBRID_SHARD", 0.8), ("ddp", 0.9)):
                writer.writerow({"model": "gpt2-tiny", "strategy": strategy, "step_s": step * scale,
                                 "step_s_min": step * scale * 0.9, "step_s_max": step * scale * 1.1,
                                 "fsdp_mpi_ratio": 1 / scale, "fsdp_mpi_ratio_min": 1 / scale,
                                 "fsdp_mpi_ratio_max": 1 / scale, "link_mb_per_step": 1.5, "note": ""})
    report = REPO_ROOT / "experiments" / "network_report.py"
    finished = subprocess.run([sys.executable, str(report), str(tmp_path), "none", "1gbit", "--vocab-size", "128"],
                              capture_output=True, text=True, timeout=120)
    check_ok(finished)
    table = (tmp_path / "network.md").read_text().splitlines()
    assert len(table) == 2 + 3 and (tmp_path / "network.png").stat().st_size > 0
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]] for line in table[2:]}
    assert rows["fsdp-mpi+HYBRID_SHARD"][1:4] == ["0.8 (0.72-0.88)", "1.25 (1.25-1.25)", "1.5"]
    assert rows["ddp"][0] == ""  # the cost model prices fsdp-mpi's strategies only
    # gpt2-tiny (vocabulary 128): a root of 12,416 elements and two blocks of 49,984, over 2 nodes of 2 ranks
    units = [Unit("<root>", 12416, 0, 0, is_root=True, tensors=4)] + [Unit(f"h.{i}", 49984, 0, 0, tensors=12)
                                                                      for i in range(2)]
    for name, strategy in (("fsdp-mpi", "FULL_SHARD"), ("fsdp-mpi+HYBRID_SHARD", "HYBRID_SHARD")):
        expected = step_link_bytes(Profile(units, 0, 0, 0), Layout(strategy, 2, 2)) / 2**20
        assert float(rows[name][0]) == pytest.approx(expected, rel=1e-3)
    refused = subprocess.run([sys.executable, str(report), str(tmp_path), "fast"], capture_output=True, text=True)
    assert refused.returncode == 2 and "rate 'fast'" in refused.stderr


def test_the_step_breakdown_tells_waiting_for_a_slower_rank_from_compute(tmp_path):
    """Rank 1 sleeps just before a unit's all-gather (tests/workers/breakdown.py): rank 0's MPI time is
    that wait, rank 1's sleep is its own compute, and each rank's parts add up to its step."""
    out = tmp_path / "breakdown.json"
    check_ok(run_mpi("breakdown.py", 2, out, timeout=120))
    result = json.loads(out.read_text())
    sleep, (early, late) = result["sleep_s"], result["ranks"]
    for rank in (early, late):
        assert rank["collectives"] >= 5  # 2 units gathered twice, reduced once, and the gradient flags
        assert rank["gradient_assembly_s"] > 0 and rank["hooks_own_s"] >= 0 and rank["mpi_moving_s"] >= 0
        assert 0 <= rank["mpi_waiting_s"] <= rank["mpi_s"]
        parts = sum(rank[part] for part in ("compute_s", "gradient_assembly_s", "hooks_own_s", "mpi_waiting_s",
                                            "mpi_moving_s"))
        assert parts == pytest.approx(rank["step_s"], abs=1e-9)
    # The ranks leave the barrier together, so rank 0 waits for rank 1's whole sleep, less how far apart
    # they left it; bounds of a fifth of the sleep leave room for scheduling on a loaded machine.
    assert early["mpi_waiting_s"] >= 0.8 * sleep and early["mpi_waiting_s"] <= early["mpi_s"]
    assert late["mpi_waiting_s"] <= 0.2 * sleep
    assert late["compute_s"] >= sleep > early["compute_s"]


def test_the_first_step_is_reported_apart_from_the_timed_ones(monkeypatch):
    """A compiled model compiles in its first step: the worker reports the slowest rank's first step, warm-up or
    not (what compiling costs, beside the step), and times only the steps after warm-up."""
    import torch
    from measuring import bench_worker

    sleeps = iter([0.2, 0.0, 0.01, 0.02])  # a first step that compiles, a warm one, then two timed
    monkeypatch.setattr(bench_worker, "train_step", lambda *_: time.sleep(next(sleeps)))

    class OneRank:
        def barrier(self):
            pass

        def all_gather_object(self, value):
            return [value]

    prepared = SimpleNamespace(comm_seconds=lambda: 0.0, comm_bytes=lambda: 0)
    times, *_, first, step_peak, process_peak = bench_worker.timed_steps(
        prepared, None, None, SimpleNamespace(warmup=2, steps=2), OneRank(), torch.device("cpu"))
    assert first >= 0.2 and len(times) == 2 and times[0] >= 0.01 and times[1] >= 0.02
    assert 0 < step_peak <= process_peak  # the timed steps' high-water mark, and the process's


def test_each_run_is_written_as_it_ends_so_that_a_bench_cut_short_keeps_it(tmp_path, monkeypatch):
    """A lent GPU's steps end at a hard time limit: every run finished before it is in -rounds.csv already."""
    import bench

    out = tmp_path / "bench.csv"
    written = []

    def run_one(name, ranks, args):
        rounds = tmp_path / "bench-rounds.csv"
        rows = list(csv.DictReader(open(rounds))) if rounds.exists() else []
        assert [(row["strategy"], row["step_s"]) for row in rows] == written  # every earlier run, as it ended
        written.append((name, f"0.{len(written) + 1}"))
        return {**dict.fromkeys(bench.MEASURED, 1.0), "strategy": name, "precision": "32", "ranks": ranks,
                "step_s": float(written[-1][1])}

    monkeypatch.setattr(bench, "run_one", run_one)
    monkeypatch.setattr(bench.bench_report, "plot_breakdown", lambda *_: None)
    monkeypatch.setattr(sys, "argv", ["bench.py", "--strategies", "plain,fsdp-mpi", "--rounds", "2", "--out", str(out)])
    assert bench.main() == 0
    assert len(written) == 4 and out.exists()


def test_mfu_counts_each_gpu_in_use_once_at_the_compute_dtypes_published_peak(monkeypatch):
    """The experiments' CSVs and bench.py share one MFU denominator (training/results.py: job_peak_flops): two
    ranks sharing a GPU count it once, two GPUs twice, at the dense peak of the precision's compute dtype;
    the GPU's peak-memory counter restarts after it, so that a measured probe is not training's peak."""
    from training import results

    monkeypatch.setattr(results, "published_peak_flops",
                        lambda device, dtype: {"bf16": 989e12, "tf32": 494.7e12, "fp32": 67e12}[dtype])
    restarted = []
    monkeypatch.setattr(results.torch.cuda, "reset_peak_memory_stats", restarted.append)

    class Ranks:  # what all_gather_object gathers when every rank is `places` of this one
        def __init__(self, *gpus):
            self.gpus = gpus

        def all_gather_object(self, place):
            host, _, flops = place
            return [(host, gpu, flops) for gpu in self.gpus]

    gpu = results.torch.device("cuda", 0)
    assert results.job_peak_flops(Ranks("cuda:0", "cuda:0"), gpu, "bf16-mixed") == 989e12
    assert results.job_peak_flops(Ranks("cuda:0", "cuda:1"), gpu, "bf16-mixed") == 2 * 989e12
    assert results.job_peak_flops(Ranks("cuda:0"), gpu, "32") == 67e12
    results.torch.set_float32_matmul_precision("high")  # what training.startup.allow_tf32 sets on a GPU
    try:
        assert results.job_peak_flops(Ranks("cuda:0"), gpu, "32") == 494.7e12
    finally:
        results.torch.set_float32_matmul_precision("highest")
    assert restarted == [gpu] * 4


def test_the_breakdown_figure_keeps_the_longest_strategy_name_and_everything_else_inside(tmp_path, monkeypatch):
    """A long name used to squeeze the bars to a sliver and push the title, axis label and legend off the figure:
    labels are wrapped now, and every text lies inside the figure (its layout, not its pixels)."""
    from measuring import bench_plan, bench_report, figures
    from measuring.reported import PARTS

    longest = "+".join(["fsdp-mpi", *bench_plan.OVERLAP, bench_plan.COMPILE, bench_plan.THROUGH_MPI,
                        max(bench_plan.SHARDING_STRATEGIES, key=len), bench_plan.COMPRESSION + "int8/bf16"])
    rows = [{"strategy": "plain", "ranks": 1, "step_s": 1.0, "compute_s": None},
            {"strategy": "plain", "ranks": 2, "step_s": 1.1},
            {"strategy": longest, "ranks": 2, "step_s": 1.2, **dict.fromkeys(PARTS, 0.24)},
            {"strategy": "fsdp-mpi+forward_prefetch+backward_prefetch+async_reduce_scatter", "ranks": 2,
             "step_s": 1.15, **dict.fromkeys(PARTS, 0.23)},
            {"strategy": "lightning-ddp", "ranks": 2, "step_s": 1.3}]
    drawn = []
    monkeypatch.setattr(figures, "save", lambda figure, path, dpi: drawn.append(figure))
    bench_report.plot_breakdown(rows, tmp_path / "breakdown.png", "gpt2-seed, batch 4 x 128 per rank, 5 rounds of 3 "
                                "steps, MPICH 5.0.2, torch 2.13.0 CPU, 1 thread per rank, medians")
    figure, = drawn
    assert figures.outside_the_figure(figure) == []
    axes = figure.axes[0]
    assert axes.get_window_extent().width > 0.45 * figure.bbox.width  # the bars, not the labels, take the width
    assert {text.get_text().replace("\n", "") for text in axes.get_yticklabels()} >= {f"{longest} (2 ranks)"}


@pytest.mark.parametrize("strategy", ["fsdp-mpi", "torch-fsdp"])
def test_heap_phases_reads_the_bytes_in_use_against_the_resident_size_at_each_phase(strategy, tmp_path):
    """experiments/heap_phases.py on gpt2-tiny, 2 ranks, 2 steps: every phase read, the bytes in use within the
    resident size and the peak at least the resident size; under fsdp-mpi's heap setting nothing new is mapped in
    a step (its mapped bytes stay as they were at its start), and its arena touches at least what it holds."""
    out = tmp_path / "phases.json"
    check_ok(run_mpi(REPO_ROOT / "experiments" / "heap_phases.py", 2, "--strategy", strategy, "--model",
                     "gpt2-tiny", "--seq-len", "32", "--steps", "2", "--out", str(out), timeout=120,
                     cwd=REPO_ROOT / "experiments"))
    report = json.loads(out.read_text())
    assert [row["step"] for row in report["steps"]] == [0, 1]
    phases = report["last_step"]
    assert [row["phase"] for row in phases][:2] == ["step starts", "forward: the first block starts"]
    assert len(phases) == 9 and phases[-1]["phase"] == "optimizer step ends"
    for row in phases:
        assert 0 < row["in_use_mb"] <= row["resident_mb"] <= row["step_peak_mb"], row
    if strategy == "fsdp-mpi":
        assert {row["mapped_mb"] for row in phases} == {phases[0]["mapped_mb"]}
    for step in report["steps"]:  # the arena holds fsdp-mpi's tensors of 64 KiB and more; FSDP2 runs without it
        arena = step["arena_most_in_use_mb"], step["arena_touched_mb"]
        assert (0 < arena[0] <= arena[1]) if strategy == "fsdp-mpi" else arena == (0, 0), step

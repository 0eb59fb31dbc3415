"""The cost model (experiments/measuring/costmodel.py) and its command line (experiments/predict.py).

Whether predictions are close to measured step times is a benchmark (predict.py
validate, quoted in the closing notes), not a test: this machine's timings move
by more than any bound worth asserting. What is tested is what must hold
exactly: the collectives the model counts are the ones fsdp-mpi issues (bytes
per step equal to the byte), the state it shards is the state the ranks hold,
the timeline's bounds, the ring formula, and refusals of bad input.
"""

import csv
import dataclasses
import random
import subprocess
import sys

import pytest

from measuring.costmodel import (Collective, Layout, Link, MeasuredNetwork, Profile, RingNetwork, Unit, collectives,
                                 node_link_bytes, predict)
from measuring.profiling import load_profile
from mpi_launch import REPO_ROOT, check_ok, child_env, experiments_launcher, mpiexec, python_command

pytestmark = pytest.mark.one_mpi  # the cost model's arithmetic and bookkeeping, not the MPI library

PREDICT = REPO_ROOT / "experiments" / "predict.py"


def run_predict(*args, timeout=600, ranks=None):
    """predict.py with `args`, as one process or, given `ranks`, under mpiexec; the ranks it launches itself
    start warm (mpi_launch.experiments_launcher)."""
    command = [mpiexec(), "-n", str(ranks), *python_command(PREDICT)] if ranks else [sys.executable, str(PREDICT)]
    return subprocess.run([*command, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=child_env(FSDP_MPI_MPIEXEC=experiments_launcher()))


def small_profile(root_numel=10, block_numel=7, blocks=2) -> Profile:
    units = [Unit("<root>", root_numel, 1.0, 2.0, is_root=True, tensors=2)]
    units += [Unit(f"block.{i}", block_numel, 0.5, 1.0, tensors=3) for i in range(blocks)]
    return Profile(units, optimizer_s=0.4, activation_bytes=1000, tokens_per_rank=64)


def test_each_strategy_issues_the_collectives_of_the_lifecycle():
    profile = small_profile()
    shapes = lambda layout: [(c.phase, c.operation, c.unit, c.bytes, c.group) for c in collectives(profile, layout)]
    # FULL_SHARD over 4: every unit gathered in forward, all but the root again in backward, every gradient
    # reduce-scattered; flat buffers padded to a multiple of 4 elements (10 -> 12, 7 -> 8) of 4 bytes; last,
    # one 4-byte flag per parameter tensor (2 + 3 + 3) over every rank: which ones got a gradient somewhere
    flags = ("backward", "all_reduce", "<which parameters got gradients>", 32, 4)
    assert shapes(Layout("FULL_SHARD", nodes=1, ranks_per_node=4)) == [
        ("forward", "all_gather", "<root>", 48, 4), ("forward", "all_gather", "block.0", 32, 4),
        ("forward", "all_gather", "block.1", 32, 4),
        ("backward", "all_gather", "block.1", 32, 4), ("backward", "reduce_scatter", "block.1", 32, 4),
        ("backward", "all_gather", "block.0", 32, 4), ("backward", "reduce_scatter", "block.0", 32, 4),
        ("backward", "reduce_scatter", "<root>", 48, 4), flags]
    # HYBRID_SHARD, 2 groups of 2: the same within the group (padding to 2), then the shard's gradient all-reduced
    hybrid = shapes(Layout("HYBRID_SHARD", nodes=2, ranks_per_node=2))
    assert [c for c in hybrid if c[1] == "all_reduce"] == [
        ("backward", "all_reduce", "block.1", 16, 2), ("backward", "all_reduce", "block.0", 16, 2),
        ("backward", "all_reduce", "<root>", 20, 2), flags]
    assert {c[4] for c in hybrid if c != flags} == {2}
    # NO_SHARD: nothing gathered, each whole gradient all-reduced over every rank
    assert shapes(Layout("NO_SHARD", nodes=2, ranks_per_node=2)) == [
        ("backward", "all_reduce", "block.1", 28, 4), ("backward", "all_reduce", "block.0", 28, 4),
        ("backward", "all_reduce", "<root>", 40, 4), flags]
    # which collectives leave the node: the shard group stays inside, the replicas (one group apart) do not
    spans = {(c.operation, c.spans_nodes) for c in collectives(profile, Layout("HYBRID_SHARD", 2, 2))}
    assert spans == {("all_gather", False), ("reduce_scatter", False), ("all_reduce", True)}
    assert all(c.spans_nodes for c in collectives(profile, Layout("FULL_SHARD", 2, 2)))


def test_serial_step_is_computation_plus_every_collective():
    profile = small_profile()
    network = RingNetwork(intra=Link(0.0, 1.0), inter=Link(0.0, 1.0))  # a collective's seconds: its ring bytes
    layout = Layout("FULL_SHARD", nodes=1, ranks_per_node=4)
    prediction = predict(profile, network, layout)
    ring_bytes = 3 / 4 * (2 * 48 + 6 * 32 + 2 * 32)  # (p - 1) / p of each buffer: the root's gather and
    # reduce-scatter, each block's two gathers and reduce-scatter, the gradient flags' all-reduce (two passes)
    assert prediction.comm_s == pytest.approx(ring_bytes)
    compute = (1 + 0.5 + 0.5) + (2 + 1 + 1) + 0.4 / 4  # forward, backward, optimizer on a quarter of the state
    assert prediction.compute_s == pytest.approx(compute)
    assert prediction.step_s == pytest.approx(compute + ring_bytes)


def test_ring_formula():
    network = RingNetwork(intra=Link(1e-6, 100e9), inter=Link(5e-6, 10e9))
    size, p = 2**30, 16
    reduce = Collective("backward", "all_reduce", "u", size, p, spans_nodes=True)
    assert network.seconds(reduce) == pytest.approx(2 * ((p - 1) * 5e-6 + (p - 1) / p * size / 10e9))
    gather = Collective("forward", "all_gather", "u", size, p, spans_nodes=False)
    assert network.seconds(gather) == pytest.approx((p - 1) * 1e-6 + (p - 1) / p * size / 100e9)


def test_each_node_sends_the_closed_form_bytes_over_its_link_in_two_levels_and_in_one_ring():
    """The bytes a node sends across its link for one collective over every rank of 2 nodes x 2 (p = 4, n = 2,
    k = 2) of a buffer of S bytes, from how each route moves it. The cluster test measures the same on the
    emulated links (test_cluster.py); this is the arithmetic alone."""
    size = 4096  # a multiple of 4 fp32 elements per rank: no padding of the all-reduce
    layout = Layout("FULL_SHARD", nodes=2, ranks_per_node=2)
    link = lambda operation, levels, widened=1.0: node_link_bytes(
        Collective("backward", operation, "u", size, 4, spans_nodes=True, widened=widened, levels=levels), layout)
    # Two levels: across the nodes, k groups of one rank per node, each exchanging 1/k of the buffer; in a group
    # of n = 2 a rank sends the other node (n - 1) / n of its group's 1/k, so a node's k ranks send (n - 1) / n =
    # 1/2 of S; an all-reduce is a reduce-scatter then an all-gather, twice that; bf16 sums travel in fp32.
    assert link("all_gather", (2, 2)) == size / 2
    assert link("reduce_scatter", (2, 2), widened=2.0) == size
    assert link("all_reduce", (2, 2)) == size
    # One flat ring of 4: each node's last rank sends the next node all but the block of the rank it sends to,
    # (p - 1) / p = 3/4 of S; a pairwise reduce-scatter sends each of a node's k ranks' blocks for the other
    # node's k ranks straight there, k (p - k) / p = S.
    assert link("all_gather", None) == 3 * size / 4
    assert link("reduce_scatter", None) == size


def test_compressed_weights_travel_as_one_byte_codes_and_a_scale_per_block():
    """An int8 gather of a unit moves a byte per element and one fp32 scale per block of 256, bf16 two bytes,
    what the compression tests count on the ranks (test_compression.py)."""
    profile = small_profile(root_numel=1000, block_numel=520, blocks=1)  # shards of 500 and 260 on 2 ranks
    gathers = lambda form: [c.bytes for c in collectives(dataclasses.replace(profile, weight_format=form),
                                                         Layout("FULL_SHARD", nodes=1, ranks_per_node=2))
                            if c.phase == "forward"]
    assert gathers("int8") == [2 * (500 + 4 * 2), 2 * (260 + 4 * 2)]  # 500 and 260 elements: 2 blocks each
    assert gathers("bf16") == [2 * 2 * 500, 2 * 2 * 260]
    assert gathers("none") == [2 * 4 * 500, 2 * 4 * 260]


def test_overlap_lies_between_the_longer_lane_and_the_serial_sum():
    generator = random.Random(0)
    for _ in range(200):
        profile = small_profile(generator.randint(1, 10**6), generator.randint(1, 10**6), generator.randint(1, 6))
        for unit in profile.units:
            unit.forward_s, unit.backward_s = generator.random(), generator.random()
        network = RingNetwork(Link(generator.random() * 1e-3, 1e6 * generator.random() + 1e3), Link(1e-3, 1e5))
        layout = Layout(generator.choice(["FULL_SHARD", "HYBRID_SHARD", "NO_SHARD"]), nodes=2, ranks_per_node=2)
        serial, overlapped = predict(profile, network, layout), predict(profile, network, layout, overlap=True)
        assert max(serial.compute_s, serial.comm_s) <= overlapped.step_s * (1 + 1e-12)
        assert overlapped.step_s <= serial.step_s * (1 + 1e-12)
    # no communication: both are the computation alone
    alone = predict(small_profile(), network, Layout("FULL_SHARD", nodes=1, ranks_per_node=1), overlap=True)
    assert alone.step_s == pytest.approx(alone.compute_s) and alone.comm_s == 0


def test_measured_network_interpolates_between_sizes_and_extends_the_end_segments():
    network = MeasuredNetwork({("all_gather", 2, 2): [(100, 1.0), (200, 3.0), (400, 4.0)]}, world=2)
    seconds = lambda size: network.seconds(Collective("forward", "all_gather", "u", size, 2, False))
    assert [seconds(s) for s in (100, 150, 200, 300, 400, 800)] == pytest.approx([1.0, 2.0, 3.0, 3.5, 4.0, 6.0])
    assert seconds(50) == 0.0  # the first segment extended down, never negative
    with pytest.raises(KeyError, match="no measured all_gather over 4 of 2 ranks"):
        network.seconds(Collective("forward", "all_gather", "u", 8, 4, False))


def test_validation_counts_the_bytes_and_state_that_four_ranks_really_have(tmp_path):
    """predict.py validate on gpt2-tiny, 4 ranks, every strategy: the model's bytes per step and sharded state
    equal what bench_worker.py measures on the ranks (comm.bytes_moved, including the split communicators)."""
    result = run_predict("validate", "--model", "gpt2-tiny", "--vocab-size", "128", "--batch-size", "2",
                         "--seq-len", "16", "--ranks", "4", "--rounds", "1", "--steps", "1", "--warmup", "1",
                         "--max-bytes", 2**18, "--repeats", "1", "--out-dir", tmp_path)
    check_ok(result)
    with open(tmp_path / "predict-validation.csv") as f:
        rows = {row["strategy"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD (2 groups of 2)", "NO_SHARD"}
    for row in rows.values():
        assert float(row["predicted_comm_mb"]) == pytest.approx(float(row["measured_comm_mb"]), rel=1e-12)
        assert float(row["predicted_state_mb"]) == pytest.approx(float(row["measured_state_mb"]), rel=1e-12)
        assert float(row["predicted_step_s"]) > 0 and float(row["measured_step_s"]) > 0
        assert float(row["predicted_peak_mb"]) > 50 and float(row["measured_peak_mb"]) > 50  # baselines included
    assert (tmp_path / "predict-validation.md").read_text().count("\n| 4 |") == 4


def test_cluster_prediction_table_and_plot(tmp_path):
    result = run_predict("cluster", "--model", "gpt2-xl", "--nodes", "1,4,16", "--out-dir", tmp_path)
    check_ok(result)
    with open(tmp_path / "predict-gpt2-xl-cluster.csv") as f:
        rows = list(csv.DictReader(f))
    assert (tmp_path / "predict-gpt2-xl-cluster.png").stat().st_size > 10_000
    value = lambda strategy, nodes, overlap, column: float(next(
        r[column] for r in rows if (r["strategy"], r["nodes"], r["overlap"]) == (strategy, str(nodes), str(overlap))))
    # sharding over every GPU divides the state by the GPUs; hybrid keeps a node's share however many nodes
    state = [value("FULL_SHARD", n, False, "memory_gib") for n in (1, 4, 16)]
    assert state[0] > state[1] > state[2]
    assert value("HYBRID_SHARD", 4, False, "memory_gib") == value("HYBRID_SHARD", 16, False, "memory_gib")
    for row in rows:
        assert float(row["compute_s"]) <= float(row["step_s"]) and 0 < float(row["scaling_efficiency"]) <= 1
        assert value(row["strategy"], row["nodes"], True, "step_s") <= value(row["strategy"], row["nodes"], False,
                                                                           "step_s")


@pytest.mark.parametrize("args, message", [
    (["cluster", "--nodes", "0,2"], "rank and node counts must be positive"),
    (["cluster", "--strategies", "ZERO_SHARD"], "choose from FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, NO_SHARD"),
    (["validate", "--ranks", "two"], "expected a comma-separated list"),
    (["profile", "--model", "gpt2-tiny", "--seq-len", "999", "--out", "p.json"], "exceeds gpt2-tiny's context"),
])
def test_bad_arguments_exit_2_with_a_message(args, message):
    result = run_predict(*args)
    assert result.returncode == 2 and message in result.stderr and "Traceback" not in result.stderr


def test_a_profile_under_mpiexec_is_taken_on_every_rank_at_once_and_written_once(tmp_path):
    """Each rank profiles its own model (the machine loaded as by a job of that many ranks); rank 0 writes
    the median rank's profile."""
    result = run_predict("profile", "--model", "gpt2-tiny", "--vocab-size", "128", "--steps", "2", "--warmup", "1",
                         "--out", tmp_path / "p.json", ranks=2, timeout=120)
    check_ok(result)
    profile = load_profile(tmp_path / "p.json")
    assert [unit.name for unit in profile.units] == ["<root>", "block.0", "block.1"]
    assert profile.step_s > 0 and profile.optimizer_s > 0 and profile.activation_bytes > 0
    assert profile.baseline_bytes > 50 * 2**20  # the interpreter, torch and MPI are resident before the model

"""Compressed communication: the formats in one process, then gpt2-tiny on 2 and 3 ranks (workers/compression.py).

Every tolerance comes from the format (u = 2^-24, float32's unit roundoff):
  int8: |decoded - x| <= absmax of x's block * (1/254 + 3u): half a step of absmax / 127, plus the roundings of
        absmax / 127, x / scale and code * scale (2.01 u of the absmax, rounded up to 3u)
  bf16: |decoded - x| <= 2^-8 |x| + 2^-134: bf16 keeps 8 significant bits (eps 2^-7), and half its subnormal spacing
"""

import json
import math

import pytest
import torch
from mpi_launch import check_ok, run_mpi
from torch import nn

from fsdp_mpi import Compression, FullyShardedDataParallel, MixedPrecision
from fsdp_mpi.communication import compression
from fsdp_mpi.communication.compression import (BFloat16Codec, Int8BlockCodec, compressed_all_reduce_sum_, dequantize_int8,
                                  quantize_int8)
from fsdp_mpi.communication.machinery.sums import sum_in_rank_order

U = torch.finfo(torch.float32).eps / 2
BF16_U = torch.finfo(torch.bfloat16).eps / 2
BF16_HALF_SUBNORMAL = torch.finfo(torch.bfloat16).tiny * torch.finfo(torch.bfloat16).eps / 2


def int8_bound(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    """(R, k) -> (R, k): the absmax of each element's block (blocks from each row's start) times 1/254 + 3u."""
    count, numel = rows.shape
    blocks = -(-numel // block_size)
    padded = torch.zeros(count, blocks * block_size, dtype=torch.float64)
    padded[:, :numel] = rows.double().abs()
    absmax = padded.view(count, blocks, block_size).amax(-1, keepdim=True).expand(-1, -1, block_size)
    return (absmax.reshape(count, -1)[:, :numel]) * (1 / 254 + 3 * U)


def int8_round_trip(rows: torch.Tensor, block_size: int) -> torch.Tensor:
    codes, scales = quantize_int8(rows, block_size)
    return dequantize_int8(codes, scales, block_size)


@pytest.mark.parametrize("block_size", [1, 7, 64, 256])
@pytest.mark.parametrize("numel", [1, 255, 1000, 1024])
def test_int8_round_trip_is_within_half_a_step_of_each_blocks_absmax(block_size, numel):
    generator = torch.Generator().manual_seed(numel * block_size)
    rows = torch.randn(3, numel, generator=generator) * torch.logspace(-20, 20, numel)  # magnitudes vary in a row
    codes, scales = quantize_int8(rows, block_size)
    assert codes.dtype == torch.int8 and codes.shape == rows.shape and int(codes.abs().max()) <= 127
    assert scales.dtype == torch.float32 and scales.shape == (3, -(-numel // block_size))
    error = (dequantize_int8(codes, scales, block_size).double() - rows.double()).abs()
    assert bool((error <= int8_bound(rows, block_size)).all())
    # Round to nearest, not toward zero: some error exceeds a quarter step.
    if numel > 1 and block_size > 1:
        assert bool((error > int8_bound(rows, block_size) / 4).any())


def test_int8_edge_cases_zeros_a_huge_value_negatives_partial_blocks_and_bf16_inputs():
    zeros = torch.zeros(2, 10)
    codes, scales = quantize_int8(zeros, 4)
    assert not codes.any() and not scales.any() and torch.equal(dequantize_int8(codes, scales, 4), zeros)

    # One huge value swamps its own block only: the block after it keeps its relative precision.
    rows = torch.tensor([[3e38, 1.0, -1.0, 0.5, 1e-3, -2e-3, 3e-3, 4e-3]])
    decoded = int8_round_trip(rows, 4)
    assert decoded[0, 0] == pytest.approx(3e38, rel=3 * U) and torch.equal(decoded[0, 1:4], torch.zeros(3))
    assert bool(((decoded - rows).abs().double() <= int8_bound(rows, 4)).all())

    # Symmetric: -x quantizes to minus the codes of x.
    rows = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    assert torch.equal(quantize_int8(-rows, 16)[0], -quantize_int8(rows, 16)[0])
    assert torch.equal(int8_round_trip(-rows, 16), -int8_round_trip(rows, 16))

    # A partial last block of one element is that element's own scale: it decodes to itself, up to rounding.
    rows = torch.tensor([[1.0, 2.0, 3.0, 4.0, -0.7]])
    assert (int8_round_trip(rows, 4)[0, 4] - rows[0, 4]).abs() <= 0.7 * 3 * U

    # bf16 inputs quantize as their fp32 values do.
    bf16 = torch.randn(2, 300, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(int8_round_trip(bf16, 64), int8_round_trip(bf16.float(), 64))


def test_bf16_codec_rounds_to_nearest_with_8_significant_bits():
    rows = torch.randn(2, 5000, generator=torch.Generator().manual_seed(2)) * torch.logspace(-30, 30, 5000)
    codec = BFloat16Codec()
    wire = codec.encode(rows)
    assert wire.dtype == torch.uint8 and wire.shape == (2, codec.wire_bytes(5000)) == (2, 10000)
    error = (codec.decode(wire, 5000).double() - rows.double()).abs()
    assert bool((error <= BF16_U * rows.double().abs() + BF16_HALF_SUBNORMAL).all())
    assert bool((error > BF16_U / 2 * rows.double().abs()).any())  # the unit roundoff is 2^-8, not 2^-9
    exact = rows.bfloat16()
    assert torch.equal(codec.decode(codec.encode(exact), 5000), exact.float())


@pytest.mark.parametrize("numel,block_size", [(1000, 256), (1024, 256), (5, 4), (3, 1)])
def test_int8_wire_is_the_codes_and_one_fp32_scale_per_block(numel, block_size):
    codec = Int8BlockCodec(block_size)
    rows = torch.randn(3, numel, generator=torch.Generator().manual_seed(3))
    wire = codec.encode(rows)
    assert wire.shape == (3, numel + 4 * math.ceil(numel / block_size)) == (3, codec.wire_bytes(numel))
    assert torch.equal(codec.decode(wire, numel), int8_round_trip(rows, block_size))


@pytest.mark.parametrize("codec", [Int8BlockCodec(7), Int8BlockCodec(256), BFloat16Codec()], ids=["int8/7", "int8/256", "bf16"])
def test_codecs_working_a_chunk_of_columns_at_a_time_give_the_bits_of_whole_rows(codec, monkeypatch):
    """Chunks of 3 x 100 values over rows of 1001: many chunks, a partial last block and a short last chunk."""
    monkeypatch.setattr(compression, "CHUNK_ELEMENTS", 300)
    rows = torch.randn(3, 1001, generator=torch.Generator().manual_seed(4)) * torch.logspace(-8, 8, 1001)
    wire = codec.encode(rows)
    assert len(compression.column_chunks(3, 1001, codec.column_multiple)) > 3
    if isinstance(codec, Int8BlockCodec):
        codes, scales = quantize_int8(rows, codec.block_size)  # whole rows at once
        blocks = scales.shape[1]
        assert torch.equal(wire[:, :4 * blocks].contiguous().view(torch.float32), scales)
        assert torch.equal(wire[:, 4 * blocks:].view(torch.int8), codes)
        whole = dequantize_int8(codes, scales, codec.block_size)
    else:
        assert torch.equal(wire.view(torch.bfloat16), rows.bfloat16())
        whole = rows.bfloat16().float()
    assert torch.equal(codec.decode(wire, 1001), whole)
    into_bf16 = torch.empty(3, 1001, dtype=torch.bfloat16)
    codec.decode_into(into_bf16, wire)
    assert torch.equal(into_bf16, whole.bfloat16())
    total, expected = torch.empty(1001), torch.empty(1001)
    codec.decode_sum_into(total, wire)
    sum_in_rank_order(list(whole), expected)
    assert torch.equal(total, expected)


def test_received_chunks_are_summed_in_fp32_in_rank_order():
    """sums.sum_in_rank_order, which every transport that adds ranks' parts itself and every compressed reduction
    uses: three ranks' parts, chosen so that the order of the additions and their precision show."""
    rows = torch.tensor([[1.0, 2.0**24, 1.0, 1.0],
                         [2.0**-24, 1.0, 2.0**-24, 2.0**-8],
                         [2.0**-24, -(2.0**24), 3.0, 2.0**-8]])
    total = torch.empty(4)
    sum_in_rank_order(list(rows), total)
    in_rank_order = (rows[0] + rows[1]) + rows[2]  # each addition rounded to fp32
    assert torch.equal(total, in_rank_order)
    assert not torch.equal(in_rank_order, rows[0] + (rows[1] + rows[2]))  # the order shows in these values
    in_bf16 = (rows[0].bfloat16() + rows[1].bfloat16()) + rows[2].bfloat16()
    assert not torch.equal(in_rank_order, in_bf16.float())  # and so does a bf16 sum
    # 16-bit parts into a 16-bit result: added in fp32, rounded once (256 + 1 + 1 is 258 in bf16; one at a time,
    # 256 + 1 rounds back to 256 twice).
    parts, summed = [torch.tensor([256.0]).bfloat16(), torch.tensor([1.0]).bfloat16(),
                     torch.tensor([1.0]).bfloat16()], torch.empty(1, dtype=torch.bfloat16)
    sum_in_rank_order(parts, summed)
    assert summed.item() == 258.0


def test_bad_compression_settings_are_named():
    with pytest.raises(ValueError, match=r"Compression.weights='int4' is not a mode: choose None, 'bf16' or 'int8'"):
        Compression(weights="int4")
    with pytest.raises(TypeError, match="Compression.gradients must be None, 'bf16' or 'int8', got torch.bfloat16"):
        Compression(gradients=torch.bfloat16)
    with pytest.raises(ValueError, match="block_size=0: a block holds at least one element"):
        Compression(weights="int8", block_size=0)
    for block_size in (2.5, True, "256"):
        with pytest.raises(TypeError, match="Compression.block_size must be an int"):
            Compression(weights="int8", block_size=block_size)
    with pytest.raises(TypeError, match="compression must be a fsdp_mpi.Compression, got 'int8'"):
        FullyShardedDataParallel(nn.Linear(2, 2), compression="int8")
    with pytest.raises(ValueError, match=r"both say how gradients are reduced: set only one"):
        FullyShardedDataParallel(nn.Linear(2, 2), compression=Compression(gradients="bf16"),
                                 mixed_precision=MixedPrecision(reduce_dtype=torch.bfloat16))


@pytest.mark.one_rank
def test_one_rank_compresses_nothing():
    """A group of one rank makes no MPI call and trains exactly as plain torch: nothing is encoded."""
    import copy

    from test_comm import OneRankThatRefusesCollectives

    from fsdp_mpi import FSDP, Communicator, ModuleWrapPolicy

    comm = Communicator(OneRankThatRefusesCollectives())
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Sequential(nn.Linear(8, 3)))
    model = FSDP(copy.deepcopy(plain), comm=comm, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                 compression=Compression(weights="int8", gradients="int8", block_size=2))
    sharded_sgd, plain_sgd = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, plain))
    for _ in range(3):
        x = torch.randn(4, 6)
        for module, optimizer in ((model, sharded_sgd), (plain, plain_sgd)):
            module(x).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
    state = model.state_dict()
    assert all(torch.equal(state[name], value) for name, value in plain.state_dict().items())
    values = torch.randn(10)
    reduced = values.clone()
    compressed_all_reduce_sum_(comm, reduced, Int8BlockCodec(4))
    assert torch.equal(reduced, values) and sum(comm.bytes_moved.values()) == 0


# ----------------------------------------------------------------- several ranks

MODES = [f"{weights}/{gradients}" for weights in ("None", "bf16", "int8") for gradients in ("None", "bf16", "int8")]


@pytest.fixture(scope="module", params=[(3, None), (4, "2")], ids=["3_ranks", "2x2_ranks"])
def report(request, tmp_path_factory):
    """3 ranks of one machine (uneven shards), and 4 as 2 nodes of 2, where every collective goes in two levels."""
    out = tmp_path_factory.mktemp("compression") / "report.json"
    ranks, node_size = request.param
    check_ok(run_mpi("compression.py", ranks, out, timeout=600,
                     env={"FSDP_MPI_EMULATED_NODE_SIZE": node_size} if node_size else None))
    return json.loads(out.read_text())


def runs(report) -> dict:
    return {**{f"full_shard/{mode}": run for mode, run in report["full_shard"].items()},
            **{f"no_shard/None/{mode}": run for mode, run in report["no_shard"].items()}}


def test_gathered_weights_are_within_the_formats_bound_of_the_masters(report):
    for mode, run in report["full_shard"].items():
        weights = run["weights"]
        assert weights["ratio"] <= 1, mode  # error / bound: 0 uncompressed (the fp32 shards themselves)
        assert weights["prefetch_same"], mode  # a prefetched gather decodes the same bits
        assert weights["changed"] == (not mode.startswith("None/")), mode


def test_reduced_gradients_are_within_each_ranks_quantization_error_of_the_exact_sum(report):
    for name, run in runs(report).items():
        assert run["gradient_ratio"] <= 1, name
    for mode, replicas in report["replica_all_reduce"].items():
        assert replicas["ratio"] <= 1 and replicas["identical_on_every_rank"], mode


def test_bytes_per_step_equal_the_closed_form(report):
    for name, run in runs(report).items():
        assert run["bytes"] == run["expected_bytes"], name
        assert run["bytes"] == run["cost_model_bytes"], name  # the cost model counts the same
    assert all(replicas["bytes_as_closed_form"] for replicas in report["replica_all_reduce"].values())
    assert all(report["all_to_all"].values())  # directly, in several messages, staged


def test_int8_weights_and_gradients_move_under_three_tenths_of_fp32(report):
    total = {mode: sum(run["bytes"].values()) for mode, run in report["full_shard"].items()}
    assert total["int8/int8"] <= 0.3 * total["None/None"]
    # Gradients in bf16 cannot get there under FULL_SHARD: per element of a unit gathered twice, int8 weights and
    # bf16 gradients move 2 (1 + 4/256) + 2 bytes where fp32 moves 12, a third.
    assert total["int8/bf16"] > total["None/None"] / 3


def test_runs_are_deterministic_and_adamw_lowers_the_loss(report):
    for name, run in runs(report).items():
        assert run["deterministic"] and run["overlap_same"], name
        assert run["losses"][-1] < run["losses"][0], name
        assert run["replicas_identical"], name  # NO_SHARD: every rank's copy, the same bits


def test_state_dicts_hold_the_fp32_masters_an_uncompressed_run_would_hold(report):
    for name, run in runs(report).items():
        assert run["masters_as_uncompressed"] and run["state_dict_is_full_state_dict"] and run["all_fp32"], name

"""Each rank keeps exactly 1/N of every unit's padded parameters; gathered memory lives only while used."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from mpi_launch import REPO_ROOT, check_ok, child_env, mpiexec, run_mpi

from fsdp_mpi_models.gpt2 import GPT2LMHeadModel, gpt2_config


_reports: dict[int, dict] = {}  # one run of the worker per rank count serves every test below


def run_memory(nprocs, tmp_path) -> dict:
    """The worker measures what live tensors hold; through MPI, not the node transport, whose exchange slots
    are tensors too, so that what it measures is parameters and gradients alone. glibc returns every allocation
    of 64 KiB or more to the kernel when it is freed, so that the kernel's peak resident size is what was
    allocated at once."""
    if nprocs not in _reports:
        out = tmp_path / f"memory{nprocs}.json"
        check_ok(run_mpi("memory.py", nprocs, out, env={"FSDP_MPI_NODE_TRANSPORT": "0",
                                                         "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}))
        _reports[nprocs] = json.loads(out.read_text())
    return _reports[nprocs]


@pytest.mark.parametrize("nprocs", [1, 2])
def test_persistent_parameters_are_one_shard_per_rank(nprocs, tmp_path):
    report = run_memory(nprocs, tmp_path)
    for handle in report["persistent"]:
        assert handle["padded_numel"] % nprocs == 0
        assert handle["shard_bytes"] == handle["padded_numel"] // nprocs * 4
        assert handle["gathered_bytes"] == 0
    total = sum(h["shard_bytes"] for h in report["persistent"])
    # model.parameters() yields the sharded views: this rank's shard minus the padding it holds.
    assert report["parameter_bytes"] == sum(h["view_bytes"] for h in report["persistent"])
    assert total - 4 * nprocs * len(report["persistent"]) < report["parameter_bytes"] <= total
    padding_bytes = sum(h["padded_numel"] * 4 for h in report["persistent"]) - report["unwrapped_bytes"]
    assert 0 <= padding_bytes < 4 * nprocs * len(report["persistent"])
    assert total == (report["unwrapped_bytes"] + padding_bytes) // nprocs
    # Measured: after wrapping, live tensors hold exactly the shards; the full parameters are gone.
    assert report["held_at_rest"] == total
    # A model of the same size, wrapped, trained one step and dropped, frees its shards and its gradients.
    assert report["dropped_model"] == {"handles_alive": 0, "bytes_freed": 2 * total}


def test_only_the_computing_unit_holds_gathered_parameters(tmp_path):
    report = run_memory(2, tmp_path)
    blocks = len(report["persistent"]) - 1
    # While block i computes, only the root (which encloses it) and block i are gathered,
    # in the training forward and in the no-grad forward that follows it.
    one_forward = [[0, i] for i in range(1, blocks + 1)]
    assert report["seen_during_blocks"] == one_forward + one_forward
    assert report["after_forward"] == [0]  # the root stays gathered: backward starts with it
    assert report["after_backward"] == []
    assert report["after_no_grad_forward"] == []
    assert report["grad_numels"] == report["shard_numels"]


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the peak")
@pytest.mark.parametrize("case,prefetched", [("no_prefetch", 0), ("prefetch", 1)])
def test_a_steps_peak_holds_the_computing_unit_and_what_prefetch_started(case, prefetched, tmp_path):
    """Measured by the kernel (the peak resident size of a step of 8 blocks, 2 ranks), not by the handles' own
    idea of what they hold. In forward: the computing block's gathered weights, and the next block's if prefetched.
    In backward also the computing block's gradient twice (as autograd hands it over, and assembled into one flat
    buffer) and its reduced half. A step that keeps every block's weights or gradients until the end of backward
    (#58) peaks at 17 blocks' worth."""
    peaks = run_memory(2, tmp_path)["step_peaks"][case]
    unit = peaks["unit_bytes"]  # one block's gathered fp32 weights; its full gradient is as large
    # The heap: what is smaller than glibc's mmap threshold (the root's 513 parameters, one row's activations of
    # 2 KiB each, autograd's nodes) stays there, in pages the earlier steps touched; 1 MiB bounds it.
    heap = 2**20
    assert peaks["forward_peak"] <= (1 + prefetched) * unit + heap
    assert peaks["backward_peak"] <= (1 + prefetched + 2 + 1 / 2) * unit + heap


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the peak")
def test_a_steps_peak_with_the_allocator_as_shipped_is_the_state_and_one_units_work(tmp_path):
    """With the allocator settings a user gets (no GLIBC_TUNABLES; units of 36 MiB, which glibc maps fresh), each
    of 4 AdamW steps peaks, above the process before the model, at no more than the sharded state (the shard,
    its gradient, AdamW's two moments: 4 shards), backward's work on one unit (its gathered weights, autograd's
    gradients and the flat gradient they are assembled into, the reduced half: 3.5 units) and AdamW's
    temporaries (two of the largest parameter's shard). Memory the
    allocator keeps beyond that, up to the 1.2x that issue #73 allows, fails it: a heap that is never trimmed keeps
    the holes between live blocks (1.21-1.36x here). Blocks' gathered weights and full gradients take their
    memory from two buffers made in the first step and reused after; the root, which keeps its weights from
    forward to backward, takes none from the pool."""
    out = tmp_path / "peak.json"
    check_ok(run_mpi("step_peak.py", 2, out))
    for rank in json.loads(out.read_text()):
        bound = 4 * rank["shard_bytes"] + 3.5 * rank["unit_bytes"] + 2 * rank["largest_shard_param_bytes"]
        assert max(rank["step_peaks"]) <= 1.2 * bound, (rank["step_peaks"], bound)
        assert rank["pooled_after_step"] == [2 * rank["unit_bytes"]] * 4


def test_forward_prefetch_gathers_the_next_unit_while_one_computes(tmp_path):
    report = run_memory(2, tmp_path)
    first_step, second_step = report["seen_with_prefetch"][:2], report["seen_with_prefetch"][2:]
    assert first_step == [[0, 1], [0, 2]]  # the first forward records the order
    assert second_step == [[0, 1, 2], [0, 2]]


def test_a_forward_recomputed_in_backward_gathers_nothing_more(tmp_path):
    """Activation checkpointing through each block's own call runs the block's forward again inside backward;
    it computes with the parameters that backward gathered: each block is gathered once in backward, also
    with forward prefetch on (the root keeps its parameters from forward)."""
    report = run_memory(2, tmp_path)
    once_each = ["transformer.h.1.block", "transformer.h.0.block"]
    assert report["gathered_in_backward_under_checkpointing"] == [once_each, once_each]


def test_no_sync_holds_full_gradients_until_the_synced_backward(tmp_path):
    report = run_memory(2, tmp_path)
    padded_bytes = sum(h["padded_numel"] * 4 for h in report["persistent"])
    shards = padded_bytes // 2
    # Under no_sync: every unit's full-size gradient, and zero_grad(set_to_none) released the sharded ones;
    # measured, live tensors hold the parameters' shards and those full gradients, nothing else.
    assert report["during_no_sync"] == {"unsharded": padded_bytes, "sharded": 0, "measured": shards + padded_bytes}
    # After the synced backward: only 1/N of the padded gradient per rank.
    assert report["after_sync"] == {"unsharded": 0, "sharded": shards, "measured": shards + shards}


# Allocates and touches 64 MiB, frees it, prints how much of it the process still holds, and allocates as much again.
RETAINED_AFTER_FREE = """
import json, os, torch
from fsdp_mpi.sharding import host_allocator
from fsdp_mpi.sharding.host_memory import keep_freed_host_memory_for_reuse
problem = keep_freed_host_memory_for_reuse()
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
before = resident()
buffer = torch.ones(16 * 2**20)
address = buffer.data_ptr()
del buffer
retained = (resident() - before) / 2**20
counts = host_allocator.counters()
print(json.dumps({"problem": problem, "retained_mib": retained,
                  "kept_mib": (counts["touched_bytes"] - counts["in_use_bytes"]) / 2**20,
                  "same_block_again": torch.empty(16 * 2**20).data_ptr() == address}))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc to read resident memory")
@pytest.mark.parametrize("value,tunables,kept", [("", "", True), ("0", "", False),
                                                 ("", "glibc.malloc.mmap_threshold=33554432", False)])
def test_freed_host_memory_is_kept_for_reuse_unless_turned_off(value, tunables, kept):
    """Turned off by FSDP_MPI_REUSE_HOST_MEMORY=0, and left to the user who tunes malloc (64 MiB is above
    that 32 MiB threshold, so glibc maps and unmaps it)."""
    env = child_env(FSDP_MPI_REUSE_HOST_MEMORY=value, GLIBC_TUNABLES=tunables)
    result = subprocess.run([sys.executable, "-c", RETAINED_AFTER_FREE], env=env, capture_output=True, text=True,
                            timeout=120)
    check_ok(result)
    report = json.loads(result.stdout)
    assert report["problem"] is None
    # Kept: the freed 64 MiB stay resident in the arena, and the next 64 MiB are that block.
    # Returned: glibc unmaps them at once (and may map the same addresses again).
    assert report["kept_mib"] == (64 if kept else 0)
    if kept:
        assert report["retained_mib"] > 60 and report["same_block_again"]
    else:
        assert report["retained_mib"] < 4


# The arena's rules, block by block, with where each block went (KiB from the arena's start, or "elsewhere") and
# the counters after it: KiB in use, KiB touched, blocks placed elsewhere.
ARENA_BLOCKS = """
import json, os, torch
from fsdp_mpi.sharding import host_allocator
KiB, MiB = 2**10, 2**20
assert host_allocator.install(capacity=128 * MiB) is None
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
seen = []
def block(event, nbytes):
    tensor = torch.ones(nbytes, dtype=torch.uint8)  # touched: resident
    offset = tensor.data_ptr() - host_allocator.counters()["arena_address"]
    counted(event, offset // KiB if 0 <= offset < 128 * MiB else "elsewhere")
    return tensor
def counted(event, where=None):
    counts = host_allocator.counters()
    seen.append([event, where, counts["in_use_bytes"] // KiB, counts["touched_bytes"] // KiB,
                 counts["blocks_elsewhere"]])
a = block("64 MiB", 64 * MiB)
del a; counted("freed")
b = block("60 MiB: the lowest fit", 60 * MiB)
c = block("8 MiB above it", 8 * MiB)
del b; counted("the 60 freed")
d = block("40 MiB", 40 * MiB)
e = block("24 MiB: 20 free below, so above", 24 * MiB)
f = block("40 MiB: no room", 40 * MiB)
small = block("1000 bytes: glibc's", 1000)
odd = block("100 KiB: two 64 KiB granules", 100 * KiB)
del c; counted("the 8 freed: merged with the 19.875 below")
del odd; counted("the 100 KiB freed: merged with the 27.875 above")
g = block("28 MiB: the merged space", 28 * MiB)
del d, e, f, g; counted("all freed")
before = resident()
host_allocator.release_free(); counted("free space released")
print(json.dumps({"seen": seen, "released_mib": (before - resident()) / MiB}))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc to read resident memory")
def test_the_arena_places_each_block_lowest_first_and_merges_freed_space():
    """Blocks of 64 KiB and more go to the lowest address they fit, in whole 64 KiB granules; freed space merges
    with its neighbours; a block the arena has no room for comes from torch's own allocator, as do smaller
    ones; what blocks touched stays resident until ``release_free`` gives it back."""
    result = subprocess.run([sys.executable, "-c", ARENA_BLOCKS], env=child_env(), capture_output=True,
                            text=True, timeout=120)
    check_ok(result)
    report = json.loads(result.stdout)
    # event, where (KiB), in use (KiB), touched (KiB), blocks elsewhere
    assert report["seen"] == [["64 MiB", 0, 65536, 65536, 0],
                              ["freed", None, 0, 65536, 0],
                              ["60 MiB: the lowest fit", 0, 61440, 65536, 0],
                              ["8 MiB above it", 61440, 69632, 69632, 0],
                              ["the 60 freed", None, 8192, 69632, 0],
                              ["40 MiB", 0, 49152, 69632, 0],
                              ["24 MiB: 20 free below, so above", 69632, 73728, 94208, 0],
                              ["40 MiB: no room", "elsewhere", 73728, 94208, 1],
                              ["1000 bytes: glibc's", "elsewhere", 73728, 94208, 1],
                              ["100 KiB: two 64 KiB granules", 40960, 73856, 94208, 1],
                              ["the 8 freed: merged with the 19.875 below", None, 65664, 94208, 1],
                              ["the 100 KiB freed: merged with the 27.875 above", None, 65536, 94208, 1],
                              ["28 MiB: the merged space", 40960, 94208, 94208, 1],
                              ["all freed", None, 0, 94208, 1],
                              ["free space released", None, 0, 0, 1]]
    assert report["released_mib"] > 80  # the 92 MiB touched, less what the kernel had not yet counted


# A model built once the arena holds new tensors (as a second model is), then wrapped on one rank: resident MiB
# above the process before it, once built and once wrapped.
WRAPPED_GIVES_BACK = """
import json, os, torch
from fsdp_mpi import FullyShardedDataParallel
from fsdp_mpi.sharding.host_memory import keep_freed_host_memory_for_reuse
assert keep_freed_host_memory_for_reuse() is None
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
before = resident()
model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024) for _ in range(16)))  # 64 MiB of weights
built = resident() - before
FullyShardedDataParallel(model, device=torch.device("cpu"))
print(json.dumps({"built_mib": built, "wrapped_mib": resident() - before}))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc to read resident memory")
def test_a_wrapped_model_gives_its_full_parameters_back_to_the_kernel():
    """The shards replace the model's parameters, which are freed; kept resident in the arena or the heap, they
    would add a model's worth to every step's peak: wrapping gives them back (one rank: the shard is the
    whole model, so what stays is one copy of it, not two)."""
    result = subprocess.run([sys.executable, "-c", WRAPPED_GIVES_BACK], env=child_env(), capture_output=True,
                            text=True, timeout=120)
    check_ok(result)
    report = json.loads(result.stdout)
    assert 60 < report["built_mib"] < 72 and 60 < report["wrapped_mib"] < 80, report


# A handle's way with host memory, as host_memory.py gives it: a 64 MiB gathered buffer filled, its memory
# written through a view made before, drained, then a second storage filled; printed as JSON.
POOL_AT_WORK = """
import json, os, torch
from fsdp_mpi.sharding.host_memory import HostBuffers, buffers_for
resident = lambda: int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
buffers = buffers_for(torch.device("cpu"))
full = torch.empty(16 * 2**20)
view = full[4:8]  # made while the storage is full, as a handle's kept views are
full.untyped_storage().resize_(0)
buffers.fill(full.untyped_storage(), full.numel() * 4)
full.fill_(1.0)
view_saw_the_fill = view.tolist() == [1.0] * 4
first_address = full.data_ptr()
before = resident()
buffers.drain(full.untyped_storage())
retained = (resident() - before) / 2**20
kept = buffers.kept_bytes / 2**20
other = torch.UntypedStorage(0)
buffers.fill(other, 64 * 2**20)
print(json.dumps({"pooled": isinstance(buffers, HostBuffers), "emptied": full.untyped_storage().nbytes() == 0,
                  "retained_mib": retained, "kept_mib": kept, "kept_after_refill": buffers.kept_bytes,
                  "same_memory_again": other.data_ptr() == first_address,
                  "view_saw_the_fill": view_saw_the_fill,
                  "meta_pooled": isinstance(buffers_for(torch.device("meta")), HostBuffers)}))
"""


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs Linux /proc to read resident memory")
@pytest.mark.parametrize("value,pooled", [("", True), ("0", False)])
def test_freed_gathered_memory_is_reused_unless_turned_off(value, pooled):
    """On a CPU a drained buffer stays resident and the next fill of that size takes the same memory, which
    views made before see; FSDP_MPI_REUSE_HOST_MEMORY=0 returns it to the kernel at once (64 MiB: glibc maps
    it). Memory elsewhere (the meta device here) is never pooled."""
    result = subprocess.run([sys.executable, "-c", POOL_AT_WORK], env=child_env(FSDP_MPI_REUSE_HOST_MEMORY=value),
                            capture_output=True, text=True, timeout=120)
    check_ok(result)
    report = json.loads(result.stdout)
    assert report["pooled"] == pooled
    assert report["emptied"] and report["view_saw_the_fill"] and not report["meta_pooled"]
    assert report["kept_after_refill"] == 0
    if pooled:  # kept, resident, and given to the next storage of that size
        assert report["kept_mib"] == 64 and report["retained_mib"] > -1 and report["same_memory_again"]
    else:
        assert report["kept_mib"] == 0 and report["retained_mib"] < -60


@pytest.mark.one_mpi
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux /proc to reset the peak")
@pytest.mark.parametrize("optimizer,state_per_shard", [("sgd-stateless", 0), ("sgd", 1)])
def test_big_model_breaks_the_training_peak_down_by_kind(optimizer, state_per_shard):
    """experiments/big_model.py on 2 ranks: the state rows follow the parameter count and the optimizer
    (momentum: one fp32 value per sharded parameter, stateless SGD none), and every step's resident size is shown."""
    with torch.device("meta"):
        parameters = GPT2LMHeadModel(gpt2_config("gpt2-seed")).num_parameters()
    env = child_env()
    result = subprocess.run([mpiexec(), "-n", "2", sys.executable, "experiments/big_model.py", "--model", "gpt2-seed",
                             "--optimizer", optimizer, "--steps", "3", "--seq-len", "16"],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=240)
    check_ok(result)
    kinds = {line[:60].strip(): float(line[60:]) for line in result.stdout.splitlines()
             if line.startswith("  ") and line[60:].strip().lstrip("-").isdigit()}
    shard_mib = parameters * 4 / 2 / 2**20  # padding adds under one element per rank and unit
    assert abs(kinds["shards (fp32)"] - shard_mib) <= 1
    assert kinds["gradients (sharded, fp32)"] == kinds["shards (fp32)"]
    assert kinds["optimizer state"] == state_per_shard * kinds["shards (fp32)"]
    assert kinds["activations saved by one forward"] > 0
    resident = next(line for line in result.stdout.splitlines() if line.startswith("resident after each step"))
    assert len(resident.split(";")[0].split(":")[1].split(",")) == 3

"""Each option observed doing what it says (see workers/switches.py); equivalence tests show they change nothing."""

import json
import math

from mpi_launch import check_ok, run_mpi
from warm_ranks import SOCKETS_ENV


def test_every_switch_does_what_it_says(tmp_path):
    out = tmp_path / "switches.json"
    check_ok(run_mpi("switches.py", 3, out))
    report = json.loads(out.read_text())
    # Units: the root, then two blocks. FULL_SHARD keeps only the root gathered for backward.
    assert report["full_shard_gathered_after_forward"] == [True, False, False]
    assert report["shard_grad_op_gathered_after_forward"] == [True, True, True]
    assert report["full_shard_gathered_after_backward"] == report["shard_grad_op_gathered_after_backward"] == [False] * 3
    # In backward, block 1 prefetches block 0 and block 0 the root.
    assert report["backward_prefetch_False_started_gathers"] == 0
    assert report["backward_prefetch_True_started_gathers"] == 2
    # One reduction per unit; asynchronous ones stay running, one at a time, and all finish with backward.
    assert report["async_False_running_at_each_reduction"] == [0, 0, 0]
    assert report["async_True_running_at_each_reduction"] == [1, 1, 1]
    assert report["async_False_running_after_backward"] == report["async_True_running_after_backward"] == 0
    # Checkpointing recomputes each of the two blocks' attention in backward.
    assert report["checkpointing_False_attention_calls"] == 2
    assert report["checkpointing_True_attention_calls"] == 4
    assert report["checkpointing_True_collectives"] == report["checkpointing_False_collectives"] > 0
    # Forced staging goes through host buffers; a 7-element limit splits each unit's gather into pieces.
    assert report["staged_all_gather_calls_in_forward"] == 3
    assert report["staged_staging_slots"] == ["all_gather_recv", "all_gather_send", "broadcast"]
    assert report["chunked_staging_slots"] == []
    assert report["chunked_all_gather_calls_in_forward"] == sum(math.ceil(n / 7) for n in report["shard_numels"])


def test_eager_steps_load_no_compiler(tmp_path):
    """Eager training of our GPT-2, with every switch of its eager steps, loads no compiler (0.9 s of each
    rank's start): neither the hooks that compiled code must not trace nor the model's construction on meta.
    In ranks started cold: a warm one has torch's compiler loaded from the start (harness/warm_ranks.py). A test
    of its own, on 2 ranks, so that the switches' mutants run warm."""
    out = tmp_path / "cold.json"
    check_ok(run_mpi("switches.py", 2, out, "cold", env={SOCKETS_ENV: "0"}))
    assert json.loads(out.read_text())["compiler_loaded"] == []


def test_offload_pins_and_copies_only_where_units_compute_on_a_gpu():
    """CPUOffload's one decision (``copies_to_device``), which sets pinning and step_in_backward's host thread:
    offloaded from a GPU only. Asking initialises no CUDA; on the CPU nothing is pinned whatever pin_memory says."""
    import torch

    from fsdp_mpi import CPUOffload

    offloaded, kept = CPUOffload(offload_params=True), CPUOffload(offload_params=False)
    assert offloaded.copies_to_device(torch.device("cuda", 0)) and offloaded.copies_to_device(torch.device("xpu"))
    assert not offloaded.copies_to_device(torch.device("cpu")) and not kept.copies_to_device(torch.device("cuda"))
    assert offloaded.shard_device(torch.device("cuda", 1)) == torch.device("cpu")
    assert kept.shard_device(torch.device("cuda", 1)) == torch.device("cuda", 1)
    shard = offloaded.zeros(5, torch.float32, torch.device("cpu"))
    assert shard.device.type == "cpu" and not shard.is_pinned() and shard.tolist() == [0.0] * 5
    # Nothing pinned, nothing to overlap: a gradient comes home at once (cast to the shard's dtype), and a
    # shard goes to the compute dtype as .to() takes it; no stream is made.
    from fsdp_mpi.sharding.offload import _COPY_STREAMS, on_device
    home, wait = offloaded.copy_home(torch.tensor([0.5, 1.5], dtype=torch.bfloat16), shard)
    assert home.dtype == torch.float32 and home.tolist() == [0.5, 1.5] and wait() is None
    assert on_device(shard, torch.device("cpu"), torch.bfloat16).dtype == torch.bfloat16 and not _COPY_STREAMS
    assert not torch.cuda.is_initialized()

"""The GPU lane (``python -m pytest -m gpu``): device code run for real, on 2 ranks sharing the machine's GPUs.

Every test here skips, saying so, where no CUDA device is visible. Whether one is, is asked of a child
process: pytest's own process must not initialise CUDA, since one-rank tests fork it (tests/conftest.py).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_launch import check_ok, run_mpi
from test_node_transport import check_node_edges
from test_torch_distributed import check_lightning_backend, check_torch_distributed

from fsdp_mpi import consolidate_checkpoint


def _cuda_devices() -> int:
    asked = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=120)
    return int(asked.stdout.strip() or 0) if asked.returncode == 0 else 0


CUDA_DEVICES = _cuda_devices()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(CUDA_DEVICES == 0, reason="needs a CUDA device")]

FIRST_GPU = {"CUDA_VISIBLE_DEVICES": "0"}  # the ranks share the first GPU


def on_the_gpu(args: list) -> list:
    """An experiment's test arguments (which say ``--device cpu``) with ``--device cuda`` instead."""
    at = args.index("--device")
    return [*args[:at], "--device", "cuda", *args[at + 2:]]


def test_collectives_on_the_gpu_through_the_node_and_staged(tmp_path):
    out = tmp_path / "gpu-collectives.json"
    check_ok(run_mpi("collectives.py", 2, out, "--device", "cuda", timeout=300))
    report = json.loads(out.read_text())
    routes = {name.split("/")[2] for name in report if name.startswith("cuda/route/")}
    assert routes in ({"node", "staged"}, {"node", "staged", "direct"})  # direct where MPI is CUDA-aware
    # (7 collectives x 7 dtypes + 16-bit sums in fp32 x 2 + bool sums + no elements + the route taken) x routes x
    # (whole, 16-byte chunks), + 64 MiB on each route but the node transport, as on it, + no CUDA context on
    # another GPU
    assert len(report) == (7 * 7 + 2 + 1 + 1 + 1) * len(routes) * 2 + len(routes) - 1 + 1
    assert [name for name, ok in report.items() if not ok] == []


@pytest.mark.skipif(CUDA_DEVICES < 2, reason="needs a CUDA device for each of 2 ranks")
def test_each_rank_makes_a_cuda_context_on_its_own_gpu_only(tmp_path):
    """On a node with a GPU per rank, rank 1 must not make a context on GPU 0 (about 0.5 GiB of it each, so
    that GPU 0 ran out of memory first on an 8-GPU node): not its main thread, not its communication
    thread, whose stream contexts restore the current device on exit."""
    out = tmp_path / "gpu-collectives.json"
    check_ok(run_mpi("collectives.py", 2, out, "--device", "cuda", timeout=300))
    assert json.loads(out.read_text())["cuda/no CUDA context on another rank's GPU"]


@pytest.mark.parametrize("streams", ["1", "0"])
def test_offloaded_copies_leave_the_host_free_while_the_gpu_computes(tmp_path, streams):
    """workers/offload_streams.py: a shard to the device and a gradient home behind a busy compute stream. On
    streams of their own the host returns before the GPU is done, the gradient landing in pinned memory; with
    FSDP_MPI_OFFLOAD_STREAMS=0 it waits. The values arrive either way."""
    out = tmp_path / "offload-streams.json"
    check_ok(run_mpi("offload_streams.py", 1, out, timeout=120,
                     env={**FIRST_GPU, "FSDP_MPI_OFFLOAD_STREAMS": streams}))
    found = json.loads(out.read_text())
    assert found["to_the_device_copied"] and found["home_copied"], found
    on_streams = [found["to_the_device_left_the_host_free"], found["home_left_the_host_free"], found["home_pinned"]]
    assert on_streams == [streams == "1"] * 3, found


def test_the_node_transports_edges_on_the_gpu(tmp_path):
    """workers/node_edges.py with 4 ranks sharing the first GPU: 3 ranks with a sum on a side stream, HYBRID_SHARD
    with both groups on device memory at once, the slots given back and counted, the current device kept, and
    CUDA IPC refused on rank 1 alone (issue 66)."""
    out = tmp_path / "node-edges.json"
    check_ok(run_mpi("node_edges.py", 4, out, "--device", "cuda", timeout=300, env=FIRST_GPU))
    check_node_edges(json.loads(out.read_text()), "cuda")


def test_staging_chunking_strategy_checkpointing_and_overlap_change_nothing_on_the_gpu(tmp_path):
    """workers/variants.py on the GPU: staged, chunked, in small exchanges, SHARD_GRAD_OP, checkpointed and
    overlapped (on the communication thread's side streams when staged), each bit for bit the node transport's."""
    out = tmp_path / "variants.json"
    check_ok(run_mpi("variants.py", 2, out, "--device", "cuda", env=FIRST_GPU, timeout=300))
    differing_tensors = json.loads(out.read_text())
    assert set(differing_tensors) == {"through_mpi", "staged", "chunked", "small_exchanges", "shard_grad_op",
                                      "checkpointed", "overlapped", "staged_overlapped"}
    assert differing_tensors == {variant: [] for variant in differing_tensors}


def test_the_loss_in_slabs_is_torchs_on_the_gpu_and_makes_no_fp32_copy_of_the_logits():
    """tests/test_cross_entropy.py with its tensors on the GPU, in a pytest process of its own: there the models'
    loss is taken in slabs, and a reference on the GPU in fp64 would take it the same way. Without conftest.py,
    whose guard fails a test that starts CUDA in pytest's process (for the forked children of later tests: this
    process has none)."""
    test_file = Path(__file__).with_name("test_cross_entropy.py")
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--noconftest",
                             str(test_file)],
                            env=dict(os.environ, FSDP_MPI_TEST_DEVICE="cuda"), capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0 and " passed" in result.stdout, result.stdout[-3000:]


def test_gpt2_trains_on_the_gpu_as_one_process_on_it_in_fp32_and_bf16(tmp_path):
    """workers/equivalence.py's checks for GPT-2 on the GPU: fp32 (TF32 off) and bf16 mixed precision, each
    against one process on the same GPU under the same policy, within the same derived bounds as on the CPU."""
    out = tmp_path / "equivalence.json"
    check_ok(run_mpi("equivalence.py", 2, out, "gpu", "--device", "cuda", env=FIRST_GPU, timeout=300))
    results = json.loads(out.read_text())
    assert set(results) == {"gpt2/adamw/none", "gpt2/adamw/sharded/bf16", "gpt2/adamw/no_sync/bf16/offload"}


def test_the_optimizer_stepped_inside_backward_on_the_gpu_makes_the_same_step_as_after_it(tmp_path):
    """workers/step_in_backward.py on the GPU: offloaded (the steps on a host thread while the GPU goes on),
    offloaded with no_sync and bf16, and not offloaded: parameters and optimizer state bit for bit those of
    stepping after backward, the gradients cleared."""
    out = tmp_path / "step_in_backward.json"
    check_ok(run_mpi("step_in_backward.py", 2, out, "--device", "cuda", env=FIRST_GPU, timeout=300))
    report = json.loads(out.read_text())
    assert set(report) == {"offloaded_on_the_gpu", "offloaded_no_sync_bf16_on_the_gpu", "on_the_gpu"}  # each checked there


def test_a_run_resumed_on_the_gpu_continues_bit_for_bit(tmp_path):
    """BERT, with dropout, on 2 ranks sharing the GPU and checkpointed every step. Resumed from the checkpoint one
    step before the end, its last step draws the masks the run never stopped drew (the CUDA generators come back
    with the checkpoint) and ends in the same parameters, AdamW state and schedule, bit for bit."""
    from experiment_runs import launch
    from test_resume_experiments import BERT, BERT_TOTAL_STEPS, assert_same_training_state, step_directories

    whole, parts = tmp_path / "whole", tmp_path / "parts"
    check_ok(launch("run_bert.py", 2, *on_the_gpu(BERT), "--out-dir", tmp_path / "whole-csv", "--checkpoint-dir",
                    whole, "--checkpoint-every", 1, env=FIRST_GPU))
    before, last = (f"step-{step:08d}" for step in (BERT_TOTAL_STEPS - 1, BERT_TOTAL_STEPS))
    assert step_directories(whole) == [before, last]
    shutil.copytree(whole / before, parts / before)
    (parts / "latest").write_text(f"{before}\n")
    resumed = launch("run_bert.py", 2, *on_the_gpu(BERT), "--out-dir", tmp_path / "resumed-csv", "--checkpoint-dir",
                     parts, "--resume", env=FIRST_GPU)
    check_ok(resumed)
    assert f"after optimizer step {BERT_TOTAL_STEPS - 1} of {BERT_TOTAL_STEPS}" in resumed.stdout
    assert_same_training_state(consolidate_checkpoint(parts / last), consolidate_checkpoint(whole / last))


def test_run_gpt2_trains_on_the_gpu_on_two_ranks_sharing_it(tmp_path):
    """The main experiment as a GPU user runs it, with 2 ranks on the first GPU (bf16 mixed precision): it
    finishes, its CSV says cuda, and the loss falls from about ln 65 (a uniform guess over the characters)."""
    from experiment_runs import QUICK, launch, read_rows

    check_ok(launch("run_gpt2.py", 2, *on_the_gpu(QUICK), "--precision", "bf16-mixed", "--out-dir", tmp_path,
                    env=FIRST_GPU))
    rows = read_rows(tmp_path)
    assert [row["device"] for row in rows] == ["cuda", "cuda"] and rows[0]["world_size"] == "2"
    steps = read_rows(tmp_path, per="step")
    assert float(steps[-1]["train_loss"]) < float(steps[0]["train_loss"]) <= 4.3


def test_torch_fsdp2_hsdp_and_ddp_on_the_fsdp_mpi_backend_with_two_ranks_sharing_the_gpu(tmp_path):
    """torch's own FSDP2 (fp32, bf16, HSDP) and DDP over the "fsdp_mpi" backend with 2 ranks on one GPU, which
    nccl refuses: within the bounds of the CPU test (test_torch_distributed.py), the other calls right."""
    out = tmp_path / "torch-distributed-gpu.json"
    check_ok(run_mpi("torch_distributed.py", 2, out, "--device", "cuda", env=FIRST_GPU, timeout=300))
    check_torch_distributed(json.loads(out.read_text()))


def test_lightnings_ddp_and_fsdp_strategies_on_the_fsdp_mpi_backend_on_the_gpu(tmp_path):
    """Lightning's DDPStrategy and FSDPStrategy (torch's FSDP1, which needs an accelerator) with
    ``process_group_backend="fsdp_mpi"``: a rank per GPU, as Lightning places them (one rank on a machine
    with one GPU, where only the start and a world of one are exercised)."""
    out = tmp_path / "lightning-backend-gpu.json"
    check_ok(run_mpi("lightning_backend.py", min(2, CUDA_DEVICES), out, "--device", "cuda", timeout=300))
    check_lightning_backend(json.loads(out.read_text()), ["ddp", "fsdp"])

"""torch.distributed on fsdp_mpi (fsdp_mpi/distributed.py): torch's FSDP2 (plain, bf16, HSDP), DDP and a DTensor
op, and Lightning's DDPStrategy, with only their start changed to the "fsdp_mpi" backend, train as one
process; the calls beyond them against closed forms; what the backend cannot do is refused by name."""

import json

import pytest
import torch
import torch.distributed as dist
from mpi_launch import check_ok, run_mpi
from test_lightning import FP32_EPS

from fsdp_mpi.distributed import Reduction


def check_steps(steps: list[dict]) -> None:
    for step, check in enumerate(steps):
        assert check["grad_error"] <= check["grad_bound"], (step, check)
        assert check["worst_tensor_ratio"] <= 1.0, (step, check)
        assert check["loss_error"] <= check["loss_bound"], (step, check)


@pytest.mark.parametrize("nprocs", [2, 3])  # both under every MPI of CI
def test_torch_fsdp2_hsdp_ddp_and_dtensor_train_as_one_process_on_the_fsdp_mpi_backend(nprocs, tmp_path):
    """Hugging Face's GPT-2, one FSDP2 unit per block and the root (fp32, bf16 compute, HSDP on a 2-D mesh) and
    DDP: 3 SGD steps, each step's gradient and loss within the derived bound of one process's at the same
    parameters (workers/gradients.py), and the other collectives against closed forms."""
    out = tmp_path / "torch_distributed.json"
    check_ok(run_mpi("torch_distributed.py", nprocs, out, timeout=300))
    check_torch_distributed(json.loads(out.read_text()))


def test_torchs_checkpoint_layer_moves_fsdp2_state_to_the_bit_on_3_and_on_2_ranks_and_between_them(tmp_path):
    """torch.distributed.checkpoint over the backend, as FSDP2's users call it (workers/torch_checkpoint.py): the
    group's default device, full state dicts of model and optimizer set from rank 0 alone (``broadcast_from_rank0``:
    it raised an IndexError, the group listing no device), sharded and asynchronous saves (``async_save`` refused,
    finding no CPU backend) loaded back, on 3 ranks and on a group of 2, and resharded 2 -> 3 -> 2: every value
    the bits it had."""
    out = tmp_path / "torch_checkpoint.json"
    check_ok(run_mpi("torch_checkpoint.py", 3, out, tmp_path / "checkpoints", timeout=300))
    on_each = ["the group's default device is the CPU", "sharded save and load", "asynchronous save, then load"]
    assert json.loads(out.read_text()) == {
        **{f"{check} ({ranks} ranks)": True for ranks in (3, 2) for check in on_each},
        "full state dicts set from rank 0 alone (3 ranks)": True, "saved on 2, loaded on 3": True,
        "saved on 3, loaded on 2": True}


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_dtensor_fsdp2_as_its_tutorials_write_it_and_fsdp1_do_on_the_fsdp_mpi_backend_what_they_do_on_gloo(
        nprocs, tmp_path):
    """torch's clients of a group beside gloo in one job (workers/torch_clients.py): DTensor's placement changes
    (Shard, Replicate, Partial sum and max, a matmul, a 2-D mesh on an even world) to the bit and to their closed
    forms; FSDP2 as its tutorial writes it (meta device, to_empty, reset_parameters, explicit prefetch, bf16
    compute, clipping over DTensors) and FSDP1 on the CPU: the first step's gradient as gloo's (to the bit on 2
    ranks, within two sum orders' difference elsewhere), every step to the bit on 2 ranks; FSDP1's three
    state-dict types loaded back; and FSDP2 continued in a second job from a full checkpoint as the run that never
    stopped; on each backend."""
    out, second = tmp_path / "torch_clients.json", tmp_path / "continued.json"
    check_ok(run_mpi("torch_clients.py", nprocs, out, tmp_path / "checkpoints", timeout=300))
    check_ok(run_mpi("torch_clients.py", nprocs, second, tmp_path / "checkpoints", "--continue", timeout=300))
    report = json.loads(out.read_text())
    assert [check for check, ok in report.items() if not ok] == []
    even, exact = nprocs % 2 == 0, nprocs == 2
    assert sum(check.startswith("DTensor: 2-D mesh") for check in report) == 3 * even
    assert len(report) == 8 + 3 * even + 2 + 2 * exact + 2 * 3, sorted(report)
    assert json.loads(second.read_text()) == {
        f"FSDP2 tutorial: continued in a second job as never stopped ({backend})": True
        for backend in ("fsdp_mpi", "gloo")}


def test_accelerate_uses_the_group_started_before_it_and_on_a_cpu_wraps_in_ddp_asked_for_fsdp(tmp_path):
    """Hugging Face Accelerate after ``fsdp_mpi.distributed.init_process_group()`` (workers/accelerate_backend.py),
    2 ranks: without ``cpu=True`` it takes each rank for a lone process; with it, it keeps the group it found
    (numbered as MPI numbers the ranks) and, asked for FSDP, wraps in DDP over that group, whose step's gradient
    is the ranks' mean to the bit."""
    out = tmp_path / "accelerate.json"
    check_ok(run_mpi("accelerate_backend.py", 2, out, timeout=120))
    for report in json.loads(out.read_text()):
        assert report == {
            "without cpu=True": {"distributed type": "DistributedType.NO", "processes": 1},
            "the group it found is the one started before it": True, "backend": "fsdp_mpi",
            "distributed type": "DistributedType.MULTI_CPU", "its process index is MPI's rank": True,
            "its number of processes is MPI's": True, "wrapped in": "DistributedDataParallel",
            "the wrapper's group": "fsdp_mpi", "the gradient is the ranks' mean, to the bit": True}


def check_torch_distributed(report: dict) -> None:
    """torch_distributed.py's report (also on the GPU, test_gpu.py): every step of every kind within its bounds,
    every other call right."""
    assert report.pop("backend") == "fsdp_mpi"
    collectives = report.pop("collectives")
    assert [name for name, ok in collectives.items() if not ok] == [] and len(collectives) == 23
    assert sorted(report) == ["ddp", "fsdp2", "fsdp2_bf16", "hsdp"]
    for steps in report.values():
        assert len(steps) == 3
        check_steps(steps)


@pytest.mark.torch_range
@pytest.mark.one_mpi  # Lightning's own logic over the backend; the collectives are the test above's
def test_lightnings_ddp_strategy_trains_as_one_process_on_the_fsdp_mpi_backend(tmp_path):
    """``DDPStrategy(process_group_backend="fsdp_mpi")``, which Lightning starts with
    ``init_process_group("fsdp_mpi")`` and a TCP store from its MPI environment: the same bound as
    FSDPMPIStrategy's (test_lightning.py): 4 SGD steps with momentum on the same global batch."""
    out = tmp_path / "lightning_backend.json"
    check_ok(run_mpi("lightning_backend.py", 2, out, timeout=300))
    check_lightning_backend(json.loads(out.read_text()), ["ddp"])


def check_lightning_backend(report: dict, strategies: list[str]) -> None:
    """lightning_backend.py's report (on the GPU with FSDPStrategy too): each strategy on the backend, within
    the bound of 4 SGD steps in float32."""
    lr, eps = 0.1, FP32_EPS
    bound = lr * 10 * 16 * eps * max(report["gradient_norms"]) + 4 * eps * report["scale"]
    for name in strategies:
        assert report[f"{name}_backend"] == "fsdp_mpi"
        assert report[f"{name}_max_difference"] <= bound, name


class _Options:
    def __init__(self, op):
        self.reduceOp = op


def test_reduce_ops_are_sums_with_a_factor_before_and_a_division_after_or_every_ranks_values_combined():
    """AVG divides after the sum, except 16-bit floats, divided before (their sum may overflow where the mean does
    not), and integers, truncated; PREMUL_SUM multiplies before; MAX, MIN, PRODUCT and the bitwise ops combine
    every rank's values; an op with no meaning for the dtype is refused naming the call."""
    def of(op, dtype=torch.float32):
        return Reduction.of(_Options(op), "all_reduce", dtype)
    average = of(dist.ReduceOp.AVG)
    values = torch.full((3,), 10.0)
    average.after(values, 4)
    assert average.scale_before(torch.float32, 4) is None and values.tolist() == [2.5] * 3
    assert of(dist.ReduceOp.AVG, torch.float16).scale_before(torch.float16, 4) == 0.25
    halves = torch.full((2,), 10.0, dtype=torch.bfloat16)
    of(dist.ReduceOp.AVG, torch.bfloat16).after(halves, 4)
    assert halves.tolist() == [10.0, 10.0]  # divided before, not again
    integers = torch.tensor([7, -7])
    of(dist.ReduceOp.AVG, torch.int64).after(integers, 2)
    assert integers.tolist() == [3, -3]  # truncated, as C divides
    assert of(dist.ReduceOp.PREMUL_SUM(0.25)).scale_before(torch.float32, 4) == 0.25
    by_rank = torch.tensor([[1, 5, 6], [3, 2, 3]])
    combined = {op: of(op, torch.int64).combine(by_rank).tolist() for op in (
        dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT, dist.ReduceOp.BAND, dist.ReduceOp.BOR,
        dist.ReduceOp.BXOR)}
    assert list(combined.values()) == [[3, 5, 6], [1, 2, 3], [3, 10, 18], [1, 0, 2], [3, 7, 7], [2, 7, 5]]
    assert not of(dist.ReduceOp.SUM).combined and of(dist.ReduceOp.MAX).combined
    for op, dtype, refusal in ((dist.ReduceOp.PREMUL_SUM(0.5), torch.int64, "PREMUL_SUM of torch.int64 tensors"),
                               (dist.ReduceOp.AVG, torch.bool, "AVG of bool tensors"),
                               (dist.ReduceOp.BAND, torch.float32, "BAND of torch.float32 tensors"),
                               (dist.ReduceOp.MAX, torch.complex64, "MAX of complex tensors")):
        with pytest.raises(ValueError, match=f"fsdp_mpi: all_reduce with {refusal}"):
            of(op, dtype)


@pytest.mark.one_rank
def test_a_group_bound_to_a_device_answers_for_its_backend_there_and_splits():
    """torch asks a group bound to a device (init_process_group's device_id, as Lightning passes on a GPU) for
    its backend on that device, and a device mesh splits it (``split_group``, every rank naming its own part; a
    rank in none gets None) where NCCL would split its communicator: the group is its own backend on every
    device, and its splits are MPI's (torch_distributed.py splits a world of several ranks). torch never takes it
    for a communicator to split a new group from (torch 2.14 hands that to C++ as a backend, and failed). It
    lists the device types it is a backend for, which torch's checkpoint layer asks."""
    import torch.distributed.distributed_c10d as c10d

    from fsdp_mpi import Communicator
    from fsdp_mpi.distributed import MpiProcessGroup

    group = MpiProcessGroup(Communicator())
    group.bound_device_id = torch.device("cuda", 0)
    try:
        backend = group._get_backend(group.bound_device_id)
    except RuntimeError as error:  # torch's own answer: "No backend type associated with device type cuda"
        backend = str(error)
    assert backend is group and c10d._get_split_source(group) is None
    # The device types it has a backend for, as torch's checkpoint helpers ask (a Python group lists none itself).
    assert group._device_types == [torch.device("cpu"), torch.device("cuda")]
    assert group.name() == "fsdp_mpi" and group.options is None  # torch calls name() and copies the options
    group.perform_nocolor_split(group.bound_device_id)  # what a rank outside a new group calls
    part = group.split_group([0], group_name="mine", group_desc="a part")
    assert (part.group_name, part.group_desc, part.size()) == ("mine", "a part", 1)
    assert group.split_group([1]) is None  # a part this rank is not in

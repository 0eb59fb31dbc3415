"""torch.distributed on fsdp_mpi (fsdp_mpi/distributed.py): torch's FSDP2 (plain, bf16, HSDP), DDP and a DTensor
op, and Lightning's DDPStrategy, with only their start changed to the "fsdp_mpi" backend, train as one
process; the calls beyond them against closed forms; what the backend cannot do is refused by name."""

import json

import pytest
import torch
import torch.distributed as dist
from mpi_launch import check_ok, run_mpi
from test_lightning import FP32_EPS

from fsdp_mpi.distributed import _Reduction


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


def check_torch_distributed(report: dict) -> None:
    """torch_distributed.py's report (also on the GPU, test_gpu.py): every step of every kind within its bounds,
    every other call right."""
    assert report.pop("backend") == "fsdp_mpi"
    collectives = report.pop("collectives")
    assert [name for name, ok in collectives.items() if not ok] == [] and len(collectives) == 11
    assert sorted(report) == ["ddp", "fsdp2", "fsdp2_bf16", "hsdp"]
    for steps in report.values():
        assert len(steps) == 3
        check_steps(steps)


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


def test_reduce_ops_are_read_as_sums_or_refused_by_name():
    """SUM and AVG (divided by the ranks after the sum), PREMUL_SUM (each rank's values times its factor first)
    for every reduction; MAX, MIN and PRODUCT for an all-reduce only; anything else refused naming the call."""
    assert _Reduction.of(_Options(dist.ReduceOp.AVG), "reduce_scatter").kind == dist.ReduceOp.AVG
    premul = _Reduction.of(_Options(dist.ReduceOp.PREMUL_SUM(0.25)), "reduce_scatter")
    values = torch.ones(3)
    premul.before(values)
    assert premul.factor == 0.25 and values.tolist() == [0.25] * 3
    average = _Reduction.of(_Options(dist.ReduceOp.AVG), "all_reduce")
    average.after(values, 4)
    assert values.tolist() == [0.0625] * 3
    assert _Reduction.of(_Options(dist.ReduceOp.MAX), "all_reduce", sums_only=False).kind == dist.ReduceOp.MAX
    with pytest.raises(NotImplementedError, match="fsdp_mpi: reduce_scatter with RedOpType.MAX: SUM, AVG and "
                                                  "PREMUL_SUM are supported"):
        _Reduction.of(_Options(dist.ReduceOp.MAX), "reduce_scatter")
    with pytest.raises(NotImplementedError, match="all_reduce with RedOpType.BAND"):
        _Reduction.of(_Options(dist.ReduceOp.BAND), "all_reduce", sums_only=False)


@pytest.mark.one_rank
def test_a_group_bound_to_a_device_answers_for_its_backend_there():
    """torch asks a group bound to a device (init_process_group's device_id, as Lightning passes on a GPU) for
    its backend on that device, to split it for a new group or connect it ahead: the backend's group is its own
    backend on every device and does neither (torch_distributed.py makes a new group of such a world)."""
    from torch.distributed.distributed_c10d import _get_split_source

    from fsdp_mpi import Communicator
    from fsdp_mpi.distributed import MpiProcessGroup

    group = MpiProcessGroup(Communicator())
    group.bound_device_id = torch.device("cuda", 0)
    answers = []
    for ask in (lambda: group._get_backend(group.bound_device_id), lambda: _get_split_source(group)):
        try:
            answers.append(ask())
        except RuntimeError as error:  # torch's own: "No backend type associated with device type cuda"
            answers.append(str(error))
    assert answers == [group, None]  # no split: a new group is an MPI communicator of its own

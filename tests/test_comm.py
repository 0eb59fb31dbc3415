"""The Communicator: collectives on several ranks against closed forms, CUDA-awareness detection, staging."""

import ctypes
import json

import pytest
import torch
from mpi_launch import check_ok, run_mpi

from fsdp_mpi import Communicator
from fsdp_mpi.gpu_support import HostStagingBuffers, env_flag, mpi_is_cuda_aware


def test_cuda_awareness_can_be_overridden(monkeypatch):
    monkeypatch.setenv("FSDP_MPI_CUDA_AWARE", "1")
    assert mpi_is_cuda_aware() is True
    monkeypatch.setenv("FSDP_MPI_CUDA_AWARE", "no")
    assert mpi_is_cuda_aware() is False
    monkeypatch.setenv("FSDP_MPI_CUDA_AWARE", "maybe")
    with pytest.raises(ValueError, match="FSDP_MPI_CUDA_AWARE='maybe'"):
        env_flag("FSDP_MPI_CUDA_AWARE")


@pytest.mark.one_rank
def test_library_is_asked_when_not_overridden(monkeypatch):
    monkeypatch.delenv("FSDP_MPI_CUDA_AWARE", raising=False)
    from mpi4py import MPI
    library = ctypes.CDLL(MPI.__file__)
    # MPICH 4+ and Open MPI 4+ have a query; without one, fsdp_mpi would silently assume "not CUDA-aware".
    assert hasattr(library, "MPIX_GPU_query_support") or hasattr(library, "MPIX_Query_cuda_support")
    if not torch.cuda.is_available():
        assert mpi_is_cuda_aware() is False  # no CUDA here: a library claiming support would be misread


def test_staging_buffers_are_reused_and_grown():
    buffers = HostStagingBuffers()
    small = buffers.get("a", 4, torch.float32)
    again = buffers.get("a", 2, torch.float32)
    assert small.data_ptr() == again.data_ptr() and again.numel() == 2
    bigger = buffers.get("a", 100, torch.bfloat16)
    assert bigger.numel() == 100 and bigger.dtype == torch.bfloat16


@pytest.mark.one_rank
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("force_staging", [False, True])
def test_single_rank_collectives(dtype, force_staging):
    comm = Communicator(force_staging=force_staging)
    shard = torch.arange(5, dtype=dtype)
    full = torch.empty(5, dtype=dtype)
    comm.all_gather_into(full, shard)
    assert torch.equal(full, shard)
    reduced = torch.empty(5, dtype=dtype)
    comm.reduce_scatter_sum(reduced, shard * 2)
    assert torch.equal(reduced, shard * 2)


@pytest.mark.one_rank
@pytest.mark.parametrize("value,staged", [("1", True), ("0", False), ("", False)])
def test_force_staging_variable_routes_collectives_through_host_buffers(monkeypatch, value, staged):
    monkeypatch.setenv("FSDP_MPI_FORCE_STAGING", value)
    comm = Communicator()
    full = torch.empty(5)
    comm.all_gather_into(full, torch.arange(5.0))
    assert torch.equal(full, torch.arange(5.0))
    assert comm.force_staging is staged and bool(comm._staging._buffers) is staged


@pytest.mark.one_rank
def test_mismatched_buffers_are_refused():
    comm = Communicator()
    with pytest.raises(ValueError, match="full buffer has 3 elements, expected 1 x 2"):
        comm.all_gather_into(torch.empty(3), torch.empty(2))


@pytest.mark.one_rank
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("force_staging", [False, True])
def test_device_buffers_direct_and_staged(force_staging):
    comm = Communicator(force_staging=force_staging)
    shard = torch.arange(6, dtype=torch.float32, device="cuda")
    full = torch.empty(6, device="cuda")
    comm.all_gather_into(full, shard)
    assert torch.equal(full.cpu(), shard.cpu())


@pytest.mark.parametrize("nprocs", [2, 3])
def test_collectives_on_several_ranks_for_every_dtype(nprocs, tmp_path):
    out = tmp_path / "collectives.json"
    check_ok(run_mpi("collectives.py", nprocs, out))
    report = json.loads(out.read_text())
    assert report.pop("sum_and_max_of_floats") == [sum(r + 0.5 for r in range(nprocs)), 0.0]
    assert len(report) == 6 * 4 * 2 * 2 + 4  # collectives x dtypes x staging x chunking, + host buffers used
    assert [name for name, ok in report.items() if not ok] == []

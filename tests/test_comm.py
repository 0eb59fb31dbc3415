"""The Communicator: collectives on several ranks against closed forms, CUDA-awareness detection, staging."""

import copy
import ctypes
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from mpi4py import MPI
from torch.utils._python_dispatch import TorchDispatchMode
from mpi_launch import check_ok, child_env, run_mpi

from fsdp_mpi import Communicator
from fsdp_mpi.communication.routes import mpi_transport
from fsdp_mpi.communication.machinery.mpi_library import cuda_awareness
from fsdp_mpi.communication.settings import CUDA_AWARE, read_flag
from fsdp_mpi.communication.transports import direct
from fsdp_mpi.communication.transports.staged import HostStagingBuffers


def test_cuda_awareness_can_be_overridden(monkeypatch):
    monkeypatch.setenv("FSDP_MPI_CUDA_AWARE", "1")
    assert cuda_awareness().aware is True
    monkeypatch.setenv("FSDP_MPI_CUDA_AWARE", "no")
    assert cuda_awareness().aware is False
    assert cuda_awareness(given=True).aware is True  # the program's word wins over the variable
    monkeypatch.setenv("FSDP_MPI_CUDA_AWARE", "maybe")
    with pytest.raises(ValueError, match="FSDP_MPI_CUDA_AWARE='maybe'"):
        read_flag(CUDA_AWARE)


@pytest.mark.one_rank
def test_library_is_asked_when_not_overridden(monkeypatch):
    monkeypatch.delenv("FSDP_MPI_CUDA_AWARE", raising=False)
    from mpi4py import MPI
    library = ctypes.CDLL(MPI.__file__)
    # MPICH 4+ and Open MPI 4+ have a query; without one, fsdp_mpi would silently assume "not CUDA-aware".
    # Asked here directly, the library's answer must be fsdp_mpi's, whatever this machine has.
    if hasattr(library, "MPIX_GPU_query_support"):
        flag = ctypes.c_int(-1)
        assert library.MPIX_GPU_query_support(0, ctypes.byref(flag)) == 0  # 0: MPIX_GPU_SUPPORT_CUDA
        answer = flag.value == 1
    else:
        answer = library.MPIX_Query_cuda_support() == 1
    assert cuda_awareness().aware is answer


@pytest.mark.one_rank  # in a child: on a machine with a GPU the buffers are pinned, which starts CUDA, and pytest's
def test_staging_buffers_are_reused_and_grown():  # own process must not have started CUDA before it forks
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
def test_force_staging_variable_is_read_and_one_rank_stages_nothing(monkeypatch, value, staged):
    monkeypatch.setenv("FSDP_MPI_FORCE_STAGING", value)
    comm = Communicator()
    full = torch.empty(5)
    comm.all_gather_into(full, torch.arange(5.0))
    assert torch.equal(full, torch.arange(5.0))
    assert comm.force_staging is staged and comm.staging_slots == []  # several ranks stage: workers/collectives.py


class OneRankThatRefusesCollectives:
    """Stands in for an mpi4py communicator of one rank: its rank and size may be asked, nothing else."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def __getattr__(self, name):
        raise AssertionError(f"one rank called MPI: {name}")


@pytest.mark.one_rank
@pytest.mark.parametrize("param_dtype", [None, torch.bfloat16])
def test_one_rank_makes_no_mpi_call(param_dtype):
    """A group of one rank trains (wrap, forward, backward, clipping, loss scaling, state dict) without
    a single MPI call or staged copy, and in fp32 exactly as plain torch does."""
    from fsdp_mpi import FSDP, MixedPrecision, ModuleWrapPolicy, ShardedGradScaler, clip_grad_norm_
    from fsdp_mpi.communication.failures.collective_log import PROCESS_LOG

    comm = Communicator(OneRankThatRefusesCollectives(), force_staging=True)
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Sequential(torch.nn.Linear(8, 3)))
    model = FSDP(copy.deepcopy(plain), comm=comm, auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
                 mixed_precision=MixedPrecision(param_dtype=param_dtype), forward_prefetch=True,
                 backward_prefetch=True, async_reduce_scatter=True)
    scaler = ShardedGradScaler(comm)
    sharded_sgd = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    plain_sgd = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    records_before = len(PROCESS_LOG.records)
    for step in range(3):
        x = torch.randn(4, 6)
        scaler.scale(model(x).square().sum()).backward()
        scaler.unscale_(sharded_sgd)
        clip_grad_norm_(model, 1e9)
        scaler.step(sharded_sgd)
        scaler.update()
        sharded_sgd.zero_grad()
        plain(x).square().sum().backward()
        plain_sgd.step()
        plain_sgd.zero_grad()
    state = model.state_dict()
    assert comm.staging_slots == [] and sum(comm.bytes_moved.values()) == 0 and comm.seconds_in_mpi == 0
    assert len(PROCESS_LOG.records) == records_before
    if param_dtype is None:
        assert all(torch.equal(state[name], value) for name, value in plain.state_dict().items())


@pytest.mark.one_rank
def test_device_tensors_are_staged_unless_mpi_is_cuda_aware():
    """Where MPI carries a collective: direct where it can read the memory, else staged (forced on host memory
    too, for the tests). One rank's communicator itself makes no MPI call, whatever it is told."""
    on_device = torch.device("meta")  # any memory outside the host's

    def route(device, **settings):
        return mpi_transport(Communicator(**settings), MPI.COMM_WORLD, device).transport.route
    assert route(on_device, cuda_aware=False) == "staged" and route(on_device, cuda_aware=True) == "direct"
    assert route(torch.device("cpu"), cuda_aware=False) == "direct"
    assert route(torch.device("cpu"), cuda_aware=True, force_staging=True) == "staged"
    assert Communicator(force_staging=True).transport(on_device).route == "one rank"


class FakeMpiLibrary:
    """What ``ctypes.CDLL`` finds in an MPI library: MPICH's or Open MPI's CUDA query, answering `answer`."""

    def __init__(self, kind: str, answer: int):
        self.kind, self.answer = kind, answer
        if kind == "mpich":
            self.MPIX_GPU_query_support = self._mpich_query
        elif kind == "openmpi":
            self.MPIX_Query_cuda_support = lambda: answer

    def _mpich_query(self, gpu_type, flag_pointer):
        assert gpu_type == 0  # MPIX_GPU_SUPPORT_CUDA
        ctypes.cast(flag_pointer, ctypes.POINTER(ctypes.c_int)).contents.value = self.answer
        return 0


@pytest.mark.parametrize("kind,answer,aware", [("mpich", 1, True), ("mpich", 0, False), ("openmpi", 1, True),
                                               ("openmpi", 0, False), ("neither", 0, False)])
def test_the_library_is_asked_and_the_log_line_says_what_it_answered(monkeypatch, kind, answer, aware):
    from fsdp_mpi.communication.machinery import mpi_library

    monkeypatch.delenv("FSDP_MPI_CUDA_AWARE", raising=False)
    monkeypatch.setattr(mpi_library.ctypes, "CDLL", lambda _path: FakeMpiLibrary(kind, answer))
    library = {"mpich": "MPICH Version: 5.0.2", "openmpi": "Open MPI v5.0.11", "neither": "Another MPI 1.0"}[kind]
    monkeypatch.setattr(mpi_library, "library_name", lambda: library)  # whatever MPI runs the test
    awareness = mpi_library.cuda_awareness()
    assert awareness.aware is aware
    line = mpi_library.describe_device_path(awareness, force_staging=False)
    assert ("straight to the CUDA-aware MPI" in line) is aware and ("staged" in line) is not aware
    assert {"mpich": f"MPIX_GPU_query_support(CUDA) gave {answer}", "openmpi": f"MPIX_Query_cuda_support() gave {answer}",
            "neither": "has no CUDA query"}[kind] in line
    assert ("FSDP_MPI_CUDA_AWARE=1 if" in line) is not aware  # the hint for a library that answers no
    monkeypatch.setenv("FSDP_MPI_CUDA_AWARE", "1")  # the user's word wins, and the line says so
    awareness = mpi_library.cuda_awareness()
    assert awareness.aware is True
    assert "FSDP_MPI_CUDA_AWARE=1)" in mpi_library.describe_device_path(awareness, force_staging=False)
    given = mpi_library.cuda_awareness(given=False)  # and the program's over the variable, named as such
    assert "Communicator(cuda_aware=False))" in mpi_library.describe_device_path(given, force_staging=False)


@pytest.mark.parametrize("offload,aware", [(None, False), ("0", False), ("1", True)])
def test_under_intel_mpi_the_log_line_says_what_its_gpu_offload_would_change(monkeypatch, offload, aware):
    """Intel MPI reads device memory only with I_MPI_OFFLOAD=1 (its query answers 0 otherwise): the line names
    that setting, not FSDP_MPI_CUDA_AWARE, and every route line says where it stands."""
    from fsdp_mpi.communication.machinery import mpi_library

    monkeypatch.delenv("FSDP_MPI_CUDA_AWARE", raising=False)
    monkeypatch.delenv("I_MPI_OFFLOAD", raising=False)
    if offload is not None:
        monkeypatch.setenv("I_MPI_OFFLOAD", offload)
    monkeypatch.setattr(mpi_library.ctypes, "CDLL", lambda _path: FakeMpiLibrary("mpich", int(aware)))
    monkeypatch.setattr(mpi_library, "library_name", lambda: "Intel(R) MPI Library 2021.18.1 for Linux* OS")
    line = mpi_library.describe_device_path(mpi_library.cuda_awareness(), force_staging=False)
    assert line.startswith("device buffers go straight" if aware else "device buffers are staged")
    assert ("set I_MPI_OFFLOAD=1 in mpiexec's environment" in line) is not aware
    assert "FSDP_MPI_CUDA_AWARE" not in line
    note = mpi_library.intel_offload_note()
    assert note.startswith("Intel(R) MPI Library 2021.18.1")
    assert note.endswith("it reads device memory itself" if aware else "I_MPI_OFFLOAD=1 lets it read them itself")
    monkeypatch.setattr(mpi_library, "library_name", lambda: "MPICH Version:      5.0.2")
    assert mpi_library.intel_offload_note() == ""


def test_intel_mpis_gpu_offload_without_a_cuda_driver_is_refused_before_mpi_starts():
    """Intel MPI's MPI_Init dies of a segmentation fault with I_MPI_OFFLOAD=1 where the CUDA driver does not
    load; importing fsdp_mpi says so first, under any MPI (only Intel MPI reads the variable)."""
    env = child_env(I_MPI_OFFLOAD="1", I_MPI_OFFLOAD_CUDA_LIBRARY="/no/such/libcuda.so")
    result = subprocess.run([sys.executable, "-c", "import fsdp_mpi"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1, result.stderr
    assert "I_MPI_OFFLOAD=1 asks Intel MPI to read GPU memory, but /no/such/libcuda.so does not load" in result.stderr


@pytest.mark.parametrize("rank,printed", [(0, 1), (1, 0)])
def test_the_route_is_printed_once_by_rank_0(capsys, monkeypatch, rank, printed):
    from fsdp_mpi.communication import routes

    monkeypatch.setattr(routes, "_route_reported", False)
    for _ in range(3):  # every model a process wraps reports; the log gets the line once
        routes.report_route_once("device buffers are staged (...)", rank)
    assert capsys.readouterr().err == "fsdp_mpi: device buffers are staged (...)\n" * printed


class _Stream(TorchDispatchMode):
    """A GPU stream, modelled on the CPU: every operation but a view leaves work queued (an allocation too: its
    memory may be a block whose last reader is still queued) until the host waits for the producer."""

    def __init__(self):
        super().__init__()
        self.queued = True  # the inputs' producers

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.queued = self.queued or not func.is_view
        return func(*args, **(kwargs or {}))


def test_the_direct_route_waits_for_the_stream_before_mpi_touches_any_piece(monkeypatch):
    """A CUDA-aware MPI reads and writes device memory on the host's time, not the stream's: every buffer the
    direct route hands it, a piece of a cut message included, must come after the host has waited for the
    stream (on an H100 under Intel MPI, cut messages went to MPI before their copies had run)."""
    stream = _Stream()
    monkeypatch.setattr(direct, "wait_for_producer", lambda tensor: setattr(stream, "queued", False))
    route = direct.Direct(SimpleNamespace(Get_size=lambda: 2), max_elements_per_message=4)
    calls = []
    route.mpi = SimpleNamespace(**{name: lambda *buffers, name=name, **_: calls.append((name, stream.queued))
                                   for name in ("all_gather", "reduce_scatter", "all_to_all", "all_reduce",
                                                "broadcast")})
    shard, full = torch.ones(10), torch.ones(20)  # 10 elements a rank in pieces of at most 4: 3 messages
    with stream:
        route.all_gather(full, shard)
        route.reduce_scatter(shard, full)
        route.all_to_all(torch.empty(20), full)
        route.all_reduce(full)
        route.broadcast(full, root=0)
    assert [name for name, _ in calls] == ["all_gather"] * 3 + ["reduce_scatter"] * 3 + ["all_to_all"] * 3 + \
        ["all_reduce"] * 5 + ["broadcast"] * 5
    assert [call for call in calls if call[1]] == []


@pytest.mark.one_rank
def test_mismatched_buffers_are_refused():
    comm = Communicator()
    with pytest.raises(ValueError, match="full buffer has 3 elements, expected 1 x 2"):
        comm.all_gather_into(torch.empty(3), torch.empty(2))


@pytest.mark.parametrize("nprocs,node_size", [(2, None), (3, None), (4, 2)], ids=["2", "3", "2x2"])
def test_collectives_on_several_ranks_for_every_dtype(nprocs, node_size, tmp_path):
    """On 2 and 3 ranks of one machine; and on 4 as 2 nodes of 2 (emulated), where every collective goes in two
    levels, inside each node by each route (MPI, staged, the node's memory) and across nodes by MPI."""
    out = tmp_path / "collectives.json"
    check_ok(run_mpi("collectives.py", nprocs, out, env={"FSDP_MPI_EMULATED_NODE_SIZE": str(node_size)}
                     if node_size else None))
    report = json.loads(out.read_text())
    assert report.pop("sum_and_max_of_floats") == [sum(r + 0.5 for r in range(nprocs)), 0.0]
    # (collectives x dtypes (4 float, 3 integer) + 16-bit sums in fp32 for the 2 16-bit dtypes + bool sums +
    # collectives of no elements) x route (direct MPI, staged, node transport) x chunking, + the route taken, +
    # device buffers handed to MPI, + started staged collectives returning before the partner joins (the
    # communication thread), + a started 16-bit reduce-scatter handed to it in fp32, + the route line's word on
    # Intel MPI's GPU offload, + an object with tensors sent from one rank to another
    assert len(report) == (7 * 7 + 2 + 1 + 1) * 3 * 2 + 6 + 7 * 2 + 4 + 1 + 1 + 1
    assert [name for name, ok in report.items() if not ok] == []

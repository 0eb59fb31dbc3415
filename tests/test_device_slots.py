"""The node transport's device memory (shared_slots.DeviceSlots, cuda_ipc.CudaRuntime) on the CPU, with CUDA's
calls faked and recorded: the order in which slots are unmapped and freed, what a rank waits for before writing
a slot again, memory given back and found again under pressure, and a thread's current device left as it was.
The GPU lane (test_gpu.py, hpc/gpu_check.sh) runs the same code on a GPU."""

import contextlib

import pytest
import torch
from test_node_transport import RankZeroOfTwo

from fsdp_mpi.communication.failures import abort
from fsdp_mpi.communication.transports import node as node_transport, shared_slots
from fsdp_mpi.communication.transports.cuda_ipc import CudaIpcError, CudaOutOfMemory, CudaRuntime, bytes_at
from fsdp_mpi.communication.transports.shared_slots import DeviceSlots, SharedSlotsError

DEVICE = torch.device("cuda", 1)


class _Stream:
    def __init__(self, log: list):
        self.log = log

    def wait_event(self, event):
        self.log.append(("wait", event.name))


class _Event:
    """An inter-process event: this rank's are named e0, e1, ... in the order made; a peer's, opened from the
    handle of its e<n>, is "peer e<n>"."""

    made = 0

    def __init__(self, interprocess=False, name=None):
        if name is None:
            name, _Event.made = f"e{_Event.made}", _Event.made + 1
        self.name = name

    def record(self, stream):
        stream.log.append(("record", self.name))

    def ipc_handle(self):
        return self.name

    @classmethod
    def from_ipc_handle(cls, device, handle):
        return cls(name=f"peer {handle}")


class _Runtime:
    """cudaMalloc and IPC as recorded calls, over CPU memory; `out_of_memory` allocations fail first."""

    def __init__(self, log: list):
        self.log, self.memory, self.out_of_memory, self.refuse_close = log, {}, 0, False

    def _new(self, nbytes: int) -> int:
        address = 0x1000 * (len(self.memory) + 1)
        self.memory[address] = torch.zeros(nbytes, dtype=torch.uint8)
        return address

    def allocate(self, device, nbytes):
        if self.out_of_memory:
            self.out_of_memory -= 1
            self.log.append(("allocate failed", nbytes))
            raise CudaOutOfMemory("cudaMalloc failed: out of memory (cudaError 2)")
        address = self._new(nbytes)
        self.log.append(("allocate", address))
        return address

    def export(self, address):
        return len(self.memory[address])  # the peer's allocation is as large as this rank's

    def open(self, device, nbytes):
        address = self._new(nbytes)
        self.log.append(("open", address))
        return address

    def close(self, device, address):
        if self.refuse_close:
            raise CudaIpcError("cudaIpcCloseMemHandle failed: invalid argument (cudaError 1)")
        self.log.append(("close", address))

    def free(self, device, address):
        self.log.append(("free", address))


@pytest.fixture
def faked(monkeypatch):
    """DeviceSlots built as rank 0 of 2 on cuda:1, with the log of every faked call and the fakes."""
    log = []
    runtime, comm, stream = _Runtime(log), RankZeroOfTwo(log), _Stream(log)
    monkeypatch.setattr(shared_slots, "CudaRuntime", lambda: runtime)
    monkeypatch.setattr(shared_slots, "bytes_at", lambda address, nbytes, device: runtime.memory[address][:nbytes])
    monkeypatch.setattr(shared_slots, "_give_back_at_exit", lambda slots: None)  # the fakes are gone by then
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device: log.append("synchronize"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: log.append("empty torch's cache"))
    _Event.made = 0
    return log, runtime, comm


def test_a_rank_waits_for_every_ranks_read_of_a_slot_its_own_included_before_writing_it_again(faked):
    """A sum reads this rank's own slot too: a later write of that slot, perhaps on another stream, must wait for
    that read as for the peers'. Events e0, e1 say "slot 0, 1 written"; e2, e3 "slot 0, 1 read"."""
    log, _, comm = faked
    slots = DeviceSlots(comm, DEVICE, limit=1024)
    log.clear()
    slots.wait_until_read(0)
    slots.wait_until_read(1)
    assert log == [("wait", "e2"), ("wait", "peer e2"), ("wait", "e3"), ("wait", "peer e3")]
    log.clear()
    slots.read(1)
    slots.written(0)
    slots.wait_until_written(0)  # a rank reads its own slot on the stream that wrote it: only the peers' writes
    assert log == [("record", "e3"), ("record", "e0"), ("wait", "peer e0")]


def test_growth_frees_a_slot_only_after_every_rank_has_finished_with_it_and_unmapped_it(faked):
    """CUDA leaves freeing memory that another process has mapped undefined: each rank's device work ends and its
    mappings of the peers' slots close, all ranks agree they have (a collective), and only then does each free its
    own; the new slots are allocated after."""
    log, runtime, comm = faked
    slots = DeviceSlots(comm, DEVICE, limit=4096)
    (own,) = [address for call, address in [c for c in log if isinstance(c, tuple)] if call == "allocate"]
    (peer,) = [address for call, address in [c for c in log if isinstance(c, tuple)] if call == "open"]
    log.clear()
    slots.ensure(2048)
    synchronized, closed, freed = log.index("synchronize"), log.index(("close", peer)), log.index(("free", own))
    assert synchronized < closed < log.index("allgather", closed) < freed
    allocated = next(i for i, call in enumerate(log) if call[0] == "allocate")
    assert log.index("allgather", freed) < allocated
    assert slots.capacity == 2048 and len(runtime.memory[log[allocated][1]]) == 2 * 2048


def test_a_failure_to_unmap_or_to_free_is_raised_on_every_rank_alike(faked):
    """Not a CudaIpcError on the failing rank alone, which would leave the others waiting in its next collective."""
    log, runtime, comm = faked
    slots = DeviceSlots(comm, DEVICE, limit=4096)
    runtime.refuse_close = True
    with pytest.raises(SharedSlotsError, match="rank 0: CudaIpcError: cudaIpcCloseMemHandle failed"):
        slots.ensure(2048)
    runtime.refuse_close = False
    slots = DeviceSlots(comm, DEVICE, limit=4096)
    comm.peer_error = "CudaIpcError: cudaFree failed"
    with pytest.raises(SharedSlotsError, match="rank 1: CudaIpcError: cudaFree failed"):
        slots.close()


def test_close_gives_the_device_memory_back_and_the_memory_column_counts_it_until_then(faked):
    log, runtime, comm = faked
    before = shared_slots.device_bytes_held_by_slots()
    slots = DeviceSlots(comm, DEVICE, limit=4096)
    slots.ensure(1024)
    assert shared_slots.device_bytes_held_by_slots() - before == slots.device_bytes == 2 * 1024
    own = [call[1] for call in log if call[0] == "allocate"][-1]
    peer = [call[1] for call in log if call[0] == "open"][-1]
    log.clear()
    slots.close()
    assert ("close", peer) in log and ("free", own) in log
    assert slots.device_bytes == 0 and shared_slots.device_bytes_held_by_slots() == before
    log.clear()
    slots.close()  # twice: nothing more to give back, no collective
    assert log == []


def test_slots_that_find_no_memory_empty_torchs_cache_and_try_once_more_then_fail_on_every_rank(faked):
    log, runtime, comm = faked
    slots = DeviceSlots(comm, DEVICE, limit=4096)
    runtime.out_of_memory = 1
    log.clear()
    slots.ensure(2048)
    failed = log.index(("allocate failed", 2 * 2048))
    assert log[failed + 1] == "empty torch's cache" and log[failed + 2][0] == "allocate"
    runtime.out_of_memory = 2
    with pytest.raises(SharedSlotsError, match="out of memory"):
        slots.ensure(4096)
    assert slots.capacity == 0 and slots.device_bytes == 0  # nothing half-made: the next growth starts afresh
    slots.ensure(4096)
    assert slots.capacity == 4096


def test_the_drivers_event_file_is_removed_at_exit_and_before_an_abort_even_when_opening_the_events_fails(
        faked, monkeypatch):
    log, runtime, comm = faked
    monkeypatch.setattr(shared_slots, "_removing_at_exit", False)
    monkeypatch.setattr(abort, "_before_abort", [])
    registered = []
    monkeypatch.setattr(shared_slots.atexit, "register", registered.append)
    monkeypatch.setattr(_Event, "from_ipc_handle", classmethod(lambda cls, device, handle: 1 / 0))
    with pytest.raises(SharedSlotsError, match="ZeroDivisionError"):
        DeviceSlots(comm, DEVICE, limit=4096)
    assert registered == abort._before_abort == [shared_slots._remove_the_drivers_event_file]
    # abort_job runs what registered before MPI_Abort, which skips atexit.
    ran, aborted = [], []
    monkeypatch.setattr(abort, "_before_abort", [lambda: ran.append("cleanup")])
    monkeypatch.setattr(abort, "SECONDS_TO_FLUSH_BEFORE_ABORT", 0)
    abort.abort_job("a rank failed", type("Comm", (), {"Abort": lambda self, code: aborted.append(ran[:])})())
    assert aborted == [["cleanup"]]


class _Library:
    """libcudart's calls as the CudaRuntime makes them, recorded; the thread's current device starts at 3."""

    def __init__(self):
        self.calls, self.current = [], 3
        for name in ("cudaGetErrorString", "cudaIpcGetMemHandle", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle"):
            setattr(self, name, self._recorder(name))

    def _recorder(self, name):
        def call(*args):
            self.calls.append(name)
            return b"no error" if name == "cudaGetErrorString" else 0
        return call

    def cudaGetDevice(self, device):
        device._obj.value = self.current  # device: ctypes.byref(a c_int)
        return 0

    def cudaSetDevice(self, index):
        self.calls.append(("cudaSetDevice", index))
        self.current = index
        return 0

    def cudaMalloc(self, address, nbytes):
        self.calls.append("cudaMalloc")
        return 2 if nbytes > 2**40 else 0  # cudaErrorMemoryAllocation

    def cudaFree(self, address):
        self.calls.append("cudaFree")
        return 0


class _Function:
    """A ctypes function's stand-in: the runtime sets argtypes and restype on it."""

    def __init__(self, call):
        self.call = call

    def __call__(self, *args):
        return self.call(*args)


def test_the_runtime_calls_on_the_named_gpu_and_leaves_the_threads_current_device_as_it_was():
    library = _Library()
    wrapped = type("Library", (), {})()
    for name in dir(library):
        if name.startswith("cuda"):
            setattr(wrapped, name, _Function(getattr(library, name)))
    runtime = CudaRuntime(wrapped)
    runtime.allocate(DEVICE, 64)
    runtime.open(DEVICE, bytes(64))
    runtime.close(DEVICE, 0x1000)
    runtime.free(DEVICE, 0x1000)
    for call in ("cudaMalloc", "cudaIpcOpenMemHandle", "cudaIpcCloseMemHandle", "cudaFree"):
        at = library.calls.index(call)
        assert library.calls[at - 1] == ("cudaSetDevice", 1) and library.calls[at + 1] == ("cudaSetDevice", 3)
    assert library.current == 3
    with pytest.raises(CudaOutOfMemory, match="cudaMalloc failed"):
        runtime.allocate(DEVICE, 2**41)
    assert library.current == 3
    with pytest.raises(CudaIpcError, match="has no index"):
        runtime.allocate(torch.device("cuda"), 64)


def test_a_gpu_named_without_an_index_takes_the_current_one_not_the_staged_route(monkeypatch):
    """`device="cuda"` used to fail inside the agreement step (cudaSetDevice(None)) and send every collective of
    the run through host memory, said only by the route line."""
    made = []

    class Node:
        def Get_size(self):
            return 2

        def Get_rank(self):
            return 0

    class World(Node):
        def Split_type(self, kind, key):
            return Node()

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(node_transport, "DeviceSlots", lambda node, device, limit: made.append(device) or object())
    transport, why = node_transport.open_node_transport(World(), torch.device("cuda"))
    assert made == [DEVICE] and transport is not None and "CUDA IPC" in why


def test_bytes_at_views_memory_on_the_device_it_is_told_whatever_holds_it():
    """A peer's slot is viewed on this rank's own device, so that a copy from it runs there (on a GPU: over peer
    access, with no context made on the peer's GPU). On the CPU, the same call over host memory."""
    memory = torch.arange(16, dtype=torch.uint8)
    view = bytes_at(memory.data_ptr() + 4, 8, torch.device("cpu"))
    assert view.device == torch.device("cpu") and view.tolist() == list(range(4, 12))
    view.fill_(0)
    assert memory[4:12].tolist() == [0] * 8 and memory[12] == 12
    assert hasattr(torch._C, "_construct_storage_from_data_pointer"), \
        "torch lacks the call bytes_at uses: peers' slots would be placed on the GPU that holds them"


"""The memory that the node transport's ranks share (fsdp_mpi/communication/transports/shared_slots.py).
HostSlots under mpiexec: what it leaves in /dev/shm after a normal end, an exception and a kill, whether made with
no name or as a named file, and how fast a failed rank ends the job. DeviceSlots on the CPU, with CUDA's calls
faked and recorded (cuda_ipc.CudaRuntime's: test_cuda_ipc.py): the order in which slots are unmapped and freed,
what a rank waits for before writing a slot again, memory given back and found again under pressure. The GPU lane
(test_gpu.py, hpc/gpu_check.sh) runs the same code on a GPU."""

import contextlib
import json
import os
import time

import pytest
import torch
from mpi_launch import check_ok, run_mpi
from test_node_transport import START_UP_SECONDS, RankZeroOfTwo

from fsdp_mpi.communication.failures import abort
from fsdp_mpi.communication.transports import shared_slots
from fsdp_mpi.communication.transports.cuda_ipc import CudaIpcError, CudaOutOfMemory
from fsdp_mpi.communication.transports.shared_slots import DeviceSlots, SharedSlotsError

DEVICE = torch.device("cuda", 1)


def segments_made_by(job_prefix: str) -> set[str]:
    """One job's shared-memory files of fsdp_mpi's (not those of MPI libraries, which leave their own when a
    rank is killed, nor those of jobs running beside it, e.g. under pytest-xdist)."""
    return {name for name in os.listdir("/dev/shm") if name.startswith(job_prefix)}


@pytest.mark.parametrize("mode", ["normal", "named", "raise", "kill", "kill-in-growth"])
def test_nothing_is_left_in_dev_shm_and_a_failed_rank_ends_the_job_in_seconds(mode, tmp_path):
    """Whether the memory is made with no name (memfd) or, where that is refused, as a named file, and whether a
    rank ends normally, raises, is killed in a collective or while the slots grow (opening the new memory, the
    moment a named file exists)."""
    out = tmp_path / "out.json"
    start = time.monotonic()
    result = run_mpi("node_files.py", 3 if mode == "normal" else 2, out, mode, timeout=START_UP_SECONDS + 60)
    elapsed = time.monotonic() - start
    job_prefix = (tmp_path / "out.json.prefix").read_text()  # "fsdp_mpi-<rank 0's pid>-", written at its start
    assert job_prefix.startswith("fsdp_mpi-") and segments_made_by(job_prefix) == set()
    if mode in ("normal", "named"):
        check_ok(result)
        report = json.loads(out.read_text())
        assert report["routes"] == {"cpu": "node"} and report["sums_right"]
        assert report["listed_while_running"] == []  # unlinked as soon as every rank had mapped it
        assert report["mapped"] == [1, 0]  # close() gave the memory back; a collective after it worked
        # Wrapping grew the slots to the unit's whole buffer at once, not to its largest tensor (1,088 bytes).
        assert report["wrapped"]["capacity"] >= report["wrapped"]["unit_bytes"] >= 108_800  # 27,200 parameters, padded
        return
    assert result.returncode != 0 and not out.exists()
    assert elapsed < START_UP_SECONDS + 15, f"the job took {elapsed:.0f} s to end after rank 1 failed"
    if mode == "raise":
        assert "rank 1 fails on purpose" in result.stderr


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

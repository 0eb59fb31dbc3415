"""Memory that every rank of a node maps: two exchange slots per rank, on the host or on the GPU.

The node transport (``node.py``) moves a collective's bytes through
these slots: a rank writes its contribution into its own slot, and, once every
rank has written, reads what it needs from the slots (its peers', and for a sum
its own). Two slots per rank, used in turn, let one barrier per exchange
suffice (see ``node.py``).

    rank 0: [slot 0][slot 1]   rank 1: [slot 0][slot 1]   ...   each `capacity` bytes

Two kinds, with one interface:

* ``HostSlots``: memory with no name that rank 0 makes (``memfd_create``) and the
  others open through ``/proc/<rank 0>/fd/``, so nothing in ``/dev/shm`` can
  outlive the job however it ends. Where that is refused, one file in
  ``/dev/shm`` that every rank maps, unlinked as soon as all have mapped it (a
  rank killed in between leaves it). (MPI-3's ``MPI_Win_allocate_shared`` gives
  the same memory, but MPICH leaves the window's segment in ``/dev/shm`` when a
  rank is killed: measured.)
* ``DeviceSlots``: one ``cudaMalloc`` per rank, mapped by each peer through CUDA
  IPC once (``cuda_ipc.py``), with inter-process CUDA events saying "my slot is
  written" and "I have read this slot", so that the GPU, not the host, waits.

Slots grow (collectively: every rank asks for the same size in the same
collective) up to the transport's chunk size, and never shrink; ``close()``
(collective) gives them back. Every step that can fail on one rank (sharing,
mapping, allocating, unmapping, freeing) is agreed: it fails on every rank of the
node alike, so none is left waiting in a collective the others have left.
"""

import atexit
import glob
import mmap
import os
import tempfile
import uuid
import weakref

import torch

from fsdp_mpi.communication.failures.abort import before_abort
from fsdp_mpi.communication.transports.cuda_ipc import CudaOutOfMemory, CudaRuntime, bytes_at

SLOTS_PER_RANK = 2
_ALIGNMENT = 256  # every slot starts at a multiple of this: any dtype can view it
_device_slots: "weakref.WeakSet[DeviceSlots]" = weakref.WeakSet()  # every live one of this process


def device_bytes_held_by_slots() -> int:
    """Device memory this process holds for its own slots, outside torch's allocator (what
    ``torch.cuda.max_memory_allocated`` leaves out)."""
    return sum(slots.device_bytes for slots in _device_slots)


class SharedSlotsError(RuntimeError):
    """The node's memory could not be shared, grown or given back; raised on every rank of the node alike."""


def _agree(mpi_comm, local_step):
    """Runs `local_step()` on every rank and returns its result here, once every rank has succeeded; if any
    failed, raises ``SharedSlotsError`` on every rank alike (so no rank is left waiting in a collective).
    Its allgather is also a barrier: no rank returns before every rank has run its step."""
    result, error = None, None
    try:
        result = local_step()
    except Exception as failure:  # noqa: BLE001 -- whatever refused, every rank must hear of it, not wait
        error = f"{type(failure).__name__}: {failure}"
    failures = [f"rank {rank}: {e}" for rank, e in enumerate(mpi_comm.allgather(error)) if e is not None]
    if failures:
        raise SharedSlotsError("; ".join(failures))
    return result


def _grown(capacity: int, needed: int, limit: int) -> int:
    """The next capacity: at least `needed`, at least double the last, at most `limit` (if that holds `needed`)."""
    grown = max(needed, min(2 * capacity, limit))
    return -(-grown // _ALIGNMENT) * _ALIGNMENT


class _Slots:
    """What both kinds share: each rank's slots as uint8 tensors of `capacity` bytes, and the four marks and
    waits of an exchange, which on the host have nothing to do: a host copy is finished when it returns, and
    the barrier between writing and reading orders the ranks' copies. ``DeviceSlots`` waits with events."""

    def __init__(self, mpi_comm, limit: int):
        self.mpi_comm, self.rank, self.world = mpi_comm, mpi_comm.Get_rank(), mpi_comm.Get_size()
        self.limit, self.capacity = limit, 0
        self._mine: list[torch.Tensor] = []
        self._peers: list[list[torch.Tensor]] = []

    def mine(self, slot: int) -> torch.Tensor:
        return self._mine[slot]

    def peer(self, rank: int, slot: int) -> torch.Tensor:
        return self._peers[rank][slot]

    def written(self, slot: int) -> None:
        pass

    def wait_until_written(self, slot: int) -> None:
        pass

    def read(self, slot: int) -> None:
        pass

    def wait_until_read(self, slot: int) -> None:
        pass

    @property
    def device_bytes(self) -> int:
        """Device memory this rank holds for its own slots, outside torch's allocator (none on the host)."""
        return 0


class HostSlots(_Slots):
    """Slots in host memory that the ranks of one node (`mpi_comm`, all on this node) share."""

    def __init__(self, mpi_comm, limit: int):
        super().__init__(mpi_comm, limit)
        self.ensure(_ALIGNMENT)  # fails here, at set-up, where memory cannot be shared at all

    def ensure(self, nbytes: int) -> None:
        """Slots of at least `nbytes` (collective when they grow: every rank asks for the same)."""
        if nbytes <= self.capacity:
            return
        capacity = _grown(self.capacity, nbytes, self.limit)
        # A peer still reading an old slot reads its own mapping of the old memory, which lives as long as it.
        views = _map_shared_memory(self.mpi_comm, self.world * SLOTS_PER_RANK * capacity).view(
            self.world, SLOTS_PER_RANK, capacity)
        self._peers = [[views[rank, slot] for slot in range(SLOTS_PER_RANK)] for rank in range(self.world)]
        self._mine, self.capacity = self._peers[self.rank], capacity

    def close(self) -> None:
        """Drops this rank's mapping (collective, like growth: the memory goes once every rank's has)."""
        self.mpi_comm.Barrier()  # every rank has finished its copies out of the slots
        self._mine, self._peers, self.capacity = [], [], 0


def _map_shared_memory(mpi_comm, nbytes: int) -> torch.Tensor:
    """`nbytes` of memory mapped by every rank of `mpi_comm`, as a uint8 tensor, with no name left anywhere.

    Rank 0 makes it (``memfd_create``; sized with ``posix_fallocate``, so that a full
    memory is an error here rather than a SIGBUS at the first write) and the others
    open it through ``/proc/<rank 0's pid>/fd/<fd>``: nothing is ever in the file
    system, so a rank killed at any moment leaves nothing behind. Where that is refused
    (no ``memfd_create``; ``/proc`` closed to the peers), a named file instead.
    """
    def make() -> tuple[int, int] | None:
        if mpi_comm.Get_rank() != 0:
            return None
        descriptor = os.memfd_create("fsdp_mpi-slots", os.MFD_CLOEXEC)
        try:
            os.posix_fallocate(descriptor, 0, nbytes)
        except OSError:
            os.close(descriptor)
            raise
        return os.getpid(), descriptor

    try:
        made = mpi_comm.bcast(_agree(mpi_comm, make), root=0)
    except (SharedSlotsError, AttributeError):  # AttributeError: an os without memfd_create, on every rank
        return _map_one_file(mpi_comm, nbytes)
    pid, descriptor = made
    path = f"/proc/self/fd/{descriptor}" if mpi_comm.Get_rank() == 0 else f"/proc/{pid}/fd/{descriptor}"
    try:
        mapping = _agree(mpi_comm, lambda: _map(path, nbytes))
    except SharedSlotsError:
        return _map_one_file(mpi_comm, nbytes)
    finally:
        if mpi_comm.Get_rank() == 0:
            os.close(descriptor)  # every rank has mapped it, or failed: the memory lives as long as the mappings
    return torch.frombuffer(mapping, dtype=torch.uint8)


def _map(path: str, nbytes: int) -> mmap.mmap:
    descriptor = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(descriptor, nbytes)
    finally:
        os.close(descriptor)


def _map_one_file(mpi_comm, nbytes: int) -> torch.Tensor:
    """`nbytes` of memory mapped by every rank of `mpi_comm` through one file, as a uint8 tensor; the file is
    already gone. Rank 0 creates and sizes it, every rank maps it, and rank 0 unlinks it once all have."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()

    def create() -> str | None:
        if mpi_comm.Get_rank() != 0:
            return None
        path = os.path.join(folder, f"fsdp_mpi-{os.getpid()}-{uuid.uuid4().hex[:12]}")
        descriptor = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(descriptor, 0, nbytes)
        except OSError:
            os.unlink(path)
            raise
        finally:
            os.close(descriptor)
        return path

    path = mpi_comm.bcast(_agree(mpi_comm, create), root=0)
    try:
        mapping = _agree(mpi_comm, lambda: _map(path, nbytes))
    finally:
        if mpi_comm.Get_rank() == 0:
            os.unlink(path)  # every rank has mapped it, or failed: the memory lives as long as the mappings
    return torch.frombuffer(mapping, dtype=torch.uint8)


class DeviceSlots(_Slots):
    """Slots in device memory: this rank's own allocation, and each peer's mapped through CUDA IPC.

    The events (``torch.cuda.Event(interprocess=True)``, one per slot and purpose) are
    recorded on the stream that writes or reads, and the streams that next write that
    slot wait for them: the host never waits for the device, except when the slots
    grow or are given back. Every rank's read events are waited for, this rank's own
    included: a sum reads this rank's own slot too, perhaps on another stream than
    the one that writes it next.
    """

    def __init__(self, mpi_comm, device: torch.device, limit: int):
        super().__init__(mpi_comm, limit)
        self.device = device
        self._allocation: int | None = None
        self._opened: list[int] = []

        def make_events():
            self._runtime = CudaRuntime()
            with torch.cuda.device(device):
                written = [torch.cuda.Event(interprocess=True) for _ in range(SLOTS_PER_RANK)]
                read = [torch.cuda.Event(interprocess=True) for _ in range(SLOTS_PER_RANK)]
                self._written, self._reads_by_rank = written, {self.rank: read}
                return [[event.ipc_handle() for event in written], [event.ipc_handle() for event in read]]

        # The driver's file behind the events exists from their making: removed at exit and before an abort,
        # whether or not what follows succeeds.
        _remove_the_drivers_event_file_at_exit()
        handles = mpi_comm.allgather(_agree(mpi_comm, make_events))

        self._peers_written: dict[int, list] = {}

        def open_events():
            for rank, (written, read) in enumerate(handles):
                if rank != self.rank:
                    self._peers_written[rank] = [torch.cuda.Event.from_ipc_handle(device, h) for h in written]
                    self._reads_by_rank[rank] = [torch.cuda.Event.from_ipc_handle(device, h) for h in read]

        _agree(mpi_comm, open_events)
        self.ensure(_ALIGNMENT)  # fails here, at set-up, where IPC is refused
        _device_slots.add(self)
        _give_back_at_exit(self)

    @property
    def device_bytes(self) -> int:
        return SLOTS_PER_RANK * self.capacity if self._allocation is not None else 0

    def ensure(self, nbytes: int) -> None:
        """Slots of at least `nbytes` (collective when they grow: every rank asks for the same)."""
        if nbytes <= self.capacity:
            return
        capacity = _grown(self.capacity, nbytes, self.limit)
        self.close()

        def allocate() -> bytes:
            try:
                self._allocation = self._runtime.allocate(self.device, SLOTS_PER_RANK * capacity)
            except CudaOutOfMemory:  # what torch's allocator keeps cached but unused may be what is missing
                torch.cuda.empty_cache()
                self._allocation = self._runtime.allocate(self.device, SLOTS_PER_RANK * capacity)
            return self._runtime.export(self._allocation)

        handles = self.mpi_comm.allgather(_agree(self.mpi_comm, allocate))

        def open_peers() -> None:
            for rank, handle in enumerate(handles):
                if rank != self.rank:
                    self._opened.append(self._runtime.open(self.device, handle))
            bases = self._opened[:self.rank] + [self._allocation] + self._opened[self.rank:]
            # On this rank's device, whichever GPU holds the memory: copies run on this rank's stream.
            whole = [bytes_at(base, SLOTS_PER_RANK * capacity, self.device) for base in bases]
            self._peers = [[memory[slot * capacity:(slot + 1) * capacity] for slot in range(SLOTS_PER_RANK)]
                           for memory in whole]

        _agree(self.mpi_comm, open_peers)
        self._mine, self.capacity = self._peers[self.rank], capacity

    def close(self) -> None:
        """Gives the slots back (collective; also the first half of growing them).

        In this order, each step agreed: this rank's device work on any slot
        finishes (the one host wait), then it unmaps its peers' memory; only once
        every rank has done both does each free its own, which no peer then reads
        or has mapped (CUDA leaves freeing memory that another process still has
        open undefined).
        """
        if self._allocation is None and not self._opened:
            return
        self._mine, self._peers, self.capacity = [], [], 0  # the tensors over the memory go before the memory

        def unmap_peers() -> None:
            torch.cuda.synchronize(self.device)
            opened, self._opened = self._opened, []
            for address in opened:
                self._runtime.close(self.device, address)

        def free_own() -> None:
            allocation, self._allocation = self._allocation, None
            if allocation is not None:
                self._runtime.free(self.device, allocation)

        _agree(self.mpi_comm, unmap_peers)
        _agree(self.mpi_comm, free_own)

    def written(self, slot: int) -> None:
        self._written[slot].record(torch.cuda.current_stream(self.device))

    def wait_until_written(self, slot: int) -> None:
        stream = torch.cuda.current_stream(self.device)
        for events in self._peers_written.values():
            stream.wait_event(events[slot])

    def read(self, slot: int) -> None:
        self._reads_by_rank[self.rank][slot].record(torch.cuda.current_stream(self.device))

    def wait_until_read(self, slot: int) -> None:
        stream = torch.cuda.current_stream(self.device)
        for events in self._reads_by_rank.values():
            stream.wait_event(events[slot])


def _give_back_at_exit(slots: DeviceSlots) -> None:
    """At a normal exit, `slots` are given back collectively before the process frees its device memory: a
    peer's queued copies out of this rank's slot must finish first. Every rank calls MPI_Finalize at exit,
    which waits for every rank anyway, so this adds no way to hang; an abort skips it (and ends every rank)."""
    held = weakref.ref(slots)

    def give_back() -> None:
        if (alive := held()) is not None:
            alive.close()
    atexit.register(give_back)


_removing_at_exit = False


def _remove_the_drivers_event_file_at_exit() -> None:
    global _removing_at_exit
    if not _removing_at_exit:
        atexit.register(_remove_the_drivers_event_file)
        before_abort(_remove_the_drivers_event_file)
        _removing_at_exit = True


def _remove_the_drivers_event_file() -> None:
    """At exit or before an abort: CUDA keeps what backs a process's inter-process events in
    ``/dev/shm/cuda.shm.<GPU>.<pid in hex>.<n>`` and removes it only when the process resets its device, so
    every rank that ever made one would leave it behind (measured on an H100, driver 580; IPC memory handles
    leave nothing). The peers mapped it when they opened our events, so its name is no longer needed. A
    killed rank's stays."""
    for path in glob.glob(f"/dev/shm/cuda.shm.*.{os.getpid():x}.*"):
        try:
            os.unlink(path)
        except OSError:
            pass

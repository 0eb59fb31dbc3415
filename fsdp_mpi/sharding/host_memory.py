"""Host memory that comes back: gathered parameters and full gradients from a pool, every other tensor of 64 KiB
and more from an arena, smaller blocks from a heap that keeps what is freed. So a unit gathered again, or its
gradient assembled again, does not fault in fresh pages, nor does a large temporary of forward and backward, and
the step's peak is what it holds at once.

Every unshard needs a unit's full buffer and every reshard frees it; every
backward assembles a unit's full gradient and its reduction frees it. glibc
serves a block above 32 MiB (and smaller ones at first) with fresh ``mmap``
pages and returns them to the kernel on free, so the next allocation pays a page
fault and zero-filling for every 4 KiB page: an all-gather into a fresh buffer
was 3.5x slower than into a reused one (64 MiB per rank, 2 ranks, MPICH shared
memory), and the logits and their gradient pay it in compute.

Three mechanisms, one switch (``FSDP_MPI_REUSE_HOST_MEMORY=0`` turns all off):

- **The pool** (``HostBuffers``): what a reshard or a reduction frees is kept, by
  its size in bytes, and the next unit that needs that many bytes takes it (units
  that gather again in backward: ``buffers_for``). A
  handle's views are bound to the storage object it made once, so a buffer moves
  in and out of that object (``UntypedStorage._swap_data_ptr_``) and the views stay
  valid, as they do across ``resize_``. It holds at most as many buffers of a size
  as were in use at once, which the step's peak holds anyway.
- **The arena** (``host_allocator``): torch's CPU allocator for tensors of 64 KiB
  and more, which packs them by address, apart from the small blocks, and keeps
  freed space resident.
- **The heap** (``keep_freed_host_memory_for_reuse``): glibc is told to map
  nothing and never trim, so every smaller freed block stays for reuse.
  A user's own ``glibc.malloc.*`` in ``GLIBC_TUNABLES`` leaves the arena and the
  heap alone.

The heap alone kept the holes between live blocks: a unit's buffers, freed and
allocated between other blocks all step long, left gaps that later blocks could
not use, and a step's peak reached 1.31x its bound (gpt2-medium, AdamW, 2 ranks);
with the pool those buffers are made once and reused, and the peak is 1.13x,
as low as with glibc's defaults (reports/2026-11-28-host-buffer-pool.md). The
activations and logits still left holes among the heap's small blocks, up to
1.4x torch FSDP2's peak; in the arena, at or below it (docs/performance.md). GPU
memory has PyTorch's caching allocator: all three serve host memory only.
"""

import ctypes
import ctypes.util
import os
from collections import defaultdict

import torch

from fsdp_mpi.communication.settings import REUSE_HOST_MEMORY, read_flag
from fsdp_mpi.sharding import host_allocator


class HostBuffers:
    """Freed host buffers kept for reuse, by size in bytes (one per process: every handle on a CPU shares it)."""

    def __init__(self):
        self._free: defaultdict[int, list[torch.UntypedStorage]] = defaultdict(list)
        self.allocated_bytes = 0  # every buffer the pool has made, in use or kept

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """Gives the empty `storage` `nbytes` of memory: a kept buffer of that size, else a new one."""
        kept = self._free.get(nbytes)
        if kept:
            storage._swap_data_ptr_(kept.pop())  # the kept object, now empty, is dropped
        else:
            storage.resize_(nbytes)
            self.allocated_bytes += nbytes

    def drain(self, storage: torch.UntypedStorage) -> None:
        """Takes `storage`'s memory into the pool; `storage` is left empty, as ``resize_(0)`` leaves it."""
        kept = torch.UntypedStorage(0)
        kept._swap_data_ptr_(storage)
        self._free[kept.nbytes()].append(kept)

    def release_kept(self) -> None:
        """Gives every buffer kept and not in use back to the heap (whose blocks any allocation may take)."""
        self.allocated_bytes -= self.kept_bytes
        self._free.clear()

    @property
    def kept_bytes(self) -> int:
        """Memory held for reuse and not in use."""
        return sum(storage.nbytes() for storages in self._free.values() for storage in storages)


class FreshBuffers:
    """No pool: every buffer is allocated anew and freed at once (GPU memory, whose allocator caches already,
    and ``FSDP_MPI_REUSE_HOST_MEMORY=0``)."""

    def fill(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        storage.resize_(nbytes)

    def drain(self, storage: torch.UntypedStorage) -> None:
        storage.resize_(0)

    kept_bytes = 0


class BorrowedBuffer:
    """A storage object that borrows memory from `buffers` while in use and gives it back after: a handle's full
    gradient, from backward to the end of its reduction. Autograd's graph may hold it (``FullViews``): it holds
    no handle."""

    def __init__(self, buffers: HostBuffers | FreshBuffers, device: torch.device):
        self.buffers, self.storage = buffers, torch.UntypedStorage(0, device=device)

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A (numel,) tensor of `dtype` in borrowed memory; a new one if the last is still in use (``no_sync``
        keeps a gradient unreduced), which autograd frees as any other."""
        if self.storage.nbytes():
            return torch.empty(numel, dtype=dtype, device=self.storage.device)
        self.buffers.fill(self.storage, numel * dtype.itemsize)
        return torch.empty(0, dtype=dtype, device=self.storage.device).set_(self.storage, 0, (numel,))

    def give_back(self) -> None:
        """The borrowed memory's user is done with it: it goes back to ``buffers``."""
        if self.storage.nbytes():
            self.buffers.drain(self.storage)


_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_decided = False


def keep_freed_host_memory_for_reuse() -> str | None:
    """Keeps freed host memory for reuse: blocks of 64 KiB and more in an arena of their own (``host_allocator``),
    smaller ones in glibc's heap, told to map nothing and never trim. Returns what a user should know (the arena
    could not be built, so large blocks come from the heap), else None.

    Idempotent; does nothing when ``FSDP_MPI_REUSE_HOST_MEMORY=0`` or when ``GLIBC_TUNABLES`` tunes malloc
    already; the heap is left as it is on a C library without ``mallopt`` (musl, macOS).
    """
    global _decided
    if _decided or read_flag(REUSE_HOST_MEMORY) is False or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    _decided = True
    libc = _libc()
    if libc is not None and hasattr(libc, "mallopt"):
        # No mmap'd chunks, and never give the heap's top back to the kernel.
        libc.mallopt(_M_MMAP_MAX, 0)
        libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
    problem = host_allocator.install()
    return f"large host blocks come from glibc's heap, not fsdp_mpi's arena: {problem}" if problem else None


def _libc():
    library = ctypes.util.find_library("c")
    return ctypes.CDLL(library) if library else None


_HOST_BUFFERS = HostBuffers()
_FRESH = FreshBuffers()


def give_back_freed_host_memory() -> None:
    """Memory freed and not to be used again goes back to the kernel: the pool's kept buffers, the arena's free
    space and every free page of the heap (``malloc_trim``, where the C library has it). Once a model is sharded,
    its full parameters, which the heap would otherwise keep resident while the step's blocks go to the arena
    (gpt2-medium, 2 ranks: a step's peak 7% higher without it); and after a run is dropped (a run rebuilt on other
    ranks), what was sized for the old run's units, so that the new run's memory is what it uses, not the old
    run's high-water mark plus its own."""
    _HOST_BUFFERS.release_kept()
    host_allocator.release_free()
    libc = _libc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def buffers_for(device: torch.device, comes_back: bool = True) -> HostBuffers | FreshBuffers:
    """Where a handle on `device` takes its gathered and gradient buffers from: the process's pool on a CPU
    where they `comes_back` within a step (a unit gathered again in backward, whose buffers its siblings of
    the same size take in turn), unless turned off or this torch cannot move a buffer between storages;
    fresh ones otherwise. A unit that keeps its weights from forward to backward (the root) frees them once a
    step: kept in the pool, they would sit idle through the next forward's peak (the logits), where the
    heap can give their memory to whatever needs it."""
    reusable = (comes_back and device.type == "cpu" and read_flag(REUSE_HOST_MEMORY) is not False
                and hasattr(torch.UntypedStorage, "_swap_data_ptr_"))
    return _HOST_BUFFERS if reusable else _FRESH

"""Host memory that comes back: gathered parameters and full gradients from a pool, everything else from a
heap that keeps what is freed. So a unit gathered again, or its gradient assembled again, does not fault in
fresh pages, nor does a large temporary of forward and backward.

Every unshard needs a unit's full buffer and every reshard frees it; every
backward assembles a unit's full gradient and its reduction frees it. glibc
serves a block above 32 MiB (and smaller ones at first) with fresh ``mmap``
pages and returns them to the kernel on free, so the next allocation pays a page
fault and zero-filling for every 4 KiB page: an all-gather into a fresh buffer
was 3.5x slower than into a reused one (64 MiB per rank, 2 ranks, MPICH shared
memory), and the logits and their gradient pay it in compute.

Two mechanisms, one switch (``FSDP_MPI_REUSE_HOST_MEMORY=0`` turns both off):

- **The pool** (``HostBuffers``): what a reshard or a reduction frees is kept, by
  its size in bytes, and the next unit that needs that many bytes takes it (units
  that gather again in backward: ``buffers_for``). A
  handle's views are bound to the storage object it made once, so a buffer moves
  in and out of that object (``UntypedStorage._swap_data_ptr_``) and the views stay
  valid, as they do across ``resize_``. It holds at most as many buffers of a size
  as were in use at once, which the step's peak holds anyway.
- **The heap** (``keep_freed_host_memory_for_reuse``): glibc is told to map
  nothing and never trim, so every other freed block stays for reuse, like
  PyTorch's CUDA caching allocator; the process keeps its peak resident size.
  A user's own ``glibc.malloc.*`` in ``GLIBC_TUNABLES`` is left alone.

The heap alone kept the holes between live blocks: a unit's buffers, freed and
allocated between other blocks all step long, left gaps that later blocks could
not use, and a step's peak reached 1.31x its bound (gpt2-medium, AdamW, 2 ranks);
with the pool those buffers are made once and reused, and the peak is 1.13x,
as low as with glibc's defaults (reports/2026-11-28-host-buffer-pool.md). GPU
memory has PyTorch's caching allocator: the pool serves host memory only.
"""

import ctypes
import ctypes.util
import os
from collections import defaultdict

import torch

from fsdp_mpi.communication.settings import REUSE_HOST_MEMORY, read_flag


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
_heap_kept = False


def keep_freed_host_memory_for_reuse() -> bool:
    """Tells glibc's malloc to keep freed memory in the heap; True if it took effect.

    Idempotent; does nothing on a C library without ``mallopt`` (musl, macOS),
    when ``FSDP_MPI_REUSE_HOST_MEMORY=0``, or when ``GLIBC_TUNABLES`` tunes malloc already.
    """
    global _heap_kept
    if _heap_kept:
        return True
    if read_flag(REUSE_HOST_MEMORY) is False or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    libc = _libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    # mallopt returns 1 on success. No mmap'd chunks, and never give the heap's top back to the kernel.
    _heap_kept = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _heap_kept


def _libc():
    library = ctypes.util.find_library("c")
    return ctypes.CDLL(library) if library else None


_HOST_BUFFERS = HostBuffers()
_FRESH = FreshBuffers()


def give_back_freed_host_memory() -> None:
    """After a run is dropped (a run rebuilt on other ranks): the pool's kept buffers, sized for the old run's
    units, and every free page of the heap go back to the kernel (``malloc_trim``), so that the new run's
    memory is what it uses, not the old run's high-water mark plus its own. Nothing where the C library has no
    ``malloc_trim``."""
    _HOST_BUFFERS.release_kept()
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

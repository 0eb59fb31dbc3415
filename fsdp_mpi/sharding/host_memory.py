"""Keeping freed host memory for reuse, so that re-gathering a unit does not fault in fresh pages.

Every unshard allocates a unit's full buffer and every reshard frees it. glibc
serves large allocations (above 32 MiB always, smaller ones at first) with
fresh ``mmap`` pages and returns them to the kernel on free; the next
allocation then pays a page fault and zero-filling for every 4 KiB page, which
made an all-gather into a fresh buffer 3.5x slower than into a reused one
(64 MiB per rank, 2 ranks, MPICH shared memory). Serving everything from the
heap and never trimming it lets freed buffers be reused at once; the cost is
that the process's resident size stays at its peak, as with PyTorch's CUDA
caching allocator. GPU memory is unaffected.

The price is memory: a heap that is never trimmed also keeps the holes between
live blocks, so a step's peak grows beyond what it holds (gpt2-large, AdamW, 2
ranks: 1.63-1.70x the sharded state against 1.25x without it) and grows over the
first steps before it settles. ``FSDP_MPI_REUSE_HOST_MEMORY=0`` turns this off; so does any
``glibc.malloc.*`` setting in ``GLIBC_TUNABLES``, which is the user's choice for
the process (docs/communication.md "Host memory" gives one that keeps most of the speed
at the lower peak).
"""

import ctypes
import ctypes.util
import os

from fsdp_mpi.communication.settings import REUSE_HOST_MEMORY, read_flag

_M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
_M_MMAP_MAX = -4
_applied = False


def keep_freed_host_memory_for_reuse() -> bool:
    """Tells glibc's malloc to keep freed memory in the heap; True if it took effect.

    Idempotent; does nothing on a C library without ``mallopt`` (musl, macOS),
    when ``FSDP_MPI_REUSE_HOST_MEMORY=0``, or when ``GLIBC_TUNABLES`` tunes malloc already.
    """
    global _applied
    if _applied:
        return True
    if read_flag(REUSE_HOST_MEMORY) is False or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    library = ctypes.util.find_library("c")
    libc = ctypes.CDLL(library) if library else None
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    # mallopt returns 1 on success. No mmap'd chunks, and never give the heap's top back to the kernel.
    _applied = bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _applied

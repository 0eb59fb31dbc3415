"""torch's CPU allocator for host blocks of 64 KiB and more: one arena of address space where each block goes to the
lowest address it fits and a freed block stays resident for the next, so a step's logits, gradients and gathered
units come back without page faults and without the holes a heap leaves between them (host_allocator.cpp says
why that packs them).

torch takes a CPU allocator only from C++, so the allocator is a small C++ file, built the first time a process
asks for it, with the machine's C++ compiler (``CXX``, else ``c++``), against the headers of the torch it runs
with, into a cache folder that every later process (and every rank) loads from: a second or so, once per torch
version. Where no compiler builds it, ``install`` says why and torch's own allocator stays.
"""

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("host_allocator.cpp")
# Smaller blocks stay in glibc's heap, where they fill holes of their own kind. Every tensor of 64 KiB and more
# goes to the arena, an activation of a small batch too: with blocks of 1 MiB and more only, gpt2-seed at 4 x 128
# tokens a rank peaked at 1,153 MB, with 64 KiB at 1,042 (the arena packs them, the heap did not).
SMALLEST_BLOCK = 2**16

_library: ctypes.CDLL | None = None


def install(capacity: int | None = None) -> str | None:
    """Makes the arena torch's CPU allocator, for blocks allocated from now on (idempotent). `capacity`: the
    address space it reserves (only what blocks touch is ever resident), by default the machine's memory; a
    block that finds no room there comes from torch's own allocator. None once installed; otherwise why not,
    and torch's allocator stays."""
    global _library
    if _library is None:
        try:
            library = ctypes.CDLL(str(_built_library()), mode=ctypes.RTLD_GLOBAL)
        except (OSError, subprocess.SubprocessError) as error:
            return str(error)
        capacity = capacity or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        installed = library.fsdp_mpi_install_host_allocator(ctypes.c_uint64(SMALLEST_BLOCK), ctypes.c_uint64(capacity))
        if installed != 1:
            return (f"could not reserve {capacity / 2**30:.1f} GiB of address space" if installed < 0
                    else "torch kept an allocator of a higher priority")
        _library = library
    return None


def release_free() -> None:
    """Gives the pages of the arena's free space back to the kernel (a run dropped: the next one's blocks are
    its own)."""
    if _library is not None:
        _library.fsdp_mpi_release_free_host_memory()


def counters() -> dict[str, int]:
    """The arena's address; bytes in use; since the last release, the most in use at once and the bytes touched
    (up to the end of the highest block placed: what the arena may hold resident); blocks that found no room.
    Zeros when not installed."""
    values = (ctypes.c_uint64 * 5)()
    if _library is not None:
        _library.fsdp_mpi_host_allocator_counters(values)
    return dict(zip(("arena_address", "in_use_bytes", "most_in_use_bytes", "touched_bytes", "blocks_elsewhere"),
                    values))


def _built_library() -> Path:
    """The allocator built for this torch, from the cache folder, building it there first if need be."""
    torch_dir = Path(torch.__file__).parent
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__} {torch_dir} {abi}".encode()).hexdigest()[:16]
    library = _cache_folder() / f"host_allocator-{key}.so"
    if library.exists():
        return library
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise OSError("no C++ compiler (set CXX, or put c++ on PATH)")
    building = library.with_name(f"{library.name}.{os.getpid()}")  # ranks that build at once each write their own
    command = [compiler, "-O2", "-std=c++17", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-I{torch_dir / 'include'}", str(SOURCE), f"-L{torch_dir / 'lib'}", "-lc10",
               f"-Wl,-rpath,{torch_dir / 'lib'}", "-o", str(building)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if result.returncode != 0:
        building.unlink(missing_ok=True)
        raise OSError(f"{compiler} could not build {SOURCE.name}: {result.stderr.strip()[-500:]}")
    os.replace(building, library)
    return library


def _cache_folder() -> Path:
    """``$XDG_CACHE_HOME/fsdp_mpi`` (``~/.cache/fsdp_mpi``), else a folder of this user's in the temporary one."""
    for folder in (Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fsdp_mpi",
                   Path(tempfile.gettempdir()) / f"fsdp_mpi-{os.getuid()}"):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(folder, os.W_OK):
            return folder
    raise OSError("no writable cache folder for the host allocator")

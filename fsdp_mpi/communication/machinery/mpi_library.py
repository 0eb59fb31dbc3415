"""What the MPI library is and whether it reads GPU memory: asked of the library, decided once per communicator
(``CudaAwareness``), and said in the words a route line uses.

A CUDA-aware MPI (most cluster builds of Open MPI, MPICH and Cray MPICH, and Intel MPI with ``I_MPI_OFFLOAD=1``)
takes device pointers directly; others need every device tensor copied to host memory first
(``transports/staged.py``).
"""

import ctypes
from dataclasses import dataclass

from mpi4py import MPI

from fsdp_mpi.communication.failures.launcher import (INTEL_MPI_CUDA_LIBRARY, INTEL_MPI_OFFLOAD, intel_mpi_offload,
                                                       intel_mpi_offload_is_on)
from fsdp_mpi.communication.settings import CUDA_AWARE, FORCE_STAGING, read_flag


_MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's mpi.h: MPIX_GPU_SUPPORT_CUDA


def library_cuda_support() -> tuple[bool, str]:
    """The MPI library's own answer to "can you read CUDA device buffers?", and how it was asked.

    Open MPI answers through ``MPIX_Query_cuda_support()``, MPICH through
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``. A library with
    neither is taken as not CUDA-aware.
    """
    # dlsym on mpi4py's extension module also searches the libmpi it links to.
    library = ctypes.CDLL(MPI.__file__)
    if hasattr(library, "MPIX_GPU_query_support"):
        flag = ctypes.c_int(0)
        status = library.MPIX_GPU_query_support(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag))
        supported = status == 0 and flag.value == 1
        return supported, f"MPIX_GPU_query_support(CUDA) gave {flag.value if status == 0 else f'error {status}'}"
    if hasattr(library, "MPIX_Query_cuda_support"):
        answer = library.MPIX_Query_cuda_support()
        return answer == 1, f"MPIX_Query_cuda_support() gave {answer}"
    return False, "the library has no CUDA query (MPIX_Query_cuda_support, MPIX_GPU_query_support)"


@dataclass(frozen=True)
class CudaAwareness:
    """Whether MPI accepts CUDA device buffers, decided once per communicator, and by what."""

    aware: bool
    decided_by: str  # what overrode the library's answer (the variable, the program), as the route line says; "": none


def cuda_awareness(given: bool | None = None) -> CudaAwareness:
    """`given` (``Communicator(cuda_aware=...)``) if not None, else ``FSDP_MPI_CUDA_AWARE=0/1`` if set, else the
    library's answer (asked only then: the query needs MPI started).

    The override helps when a library reports support that the job's environment
    disables (Cray MPICH without ``MPICH_GPU_SUPPORT_ENABLED=1``), or has no query.
    """
    if given is not None:
        return CudaAwareness(given, f"Communicator(cuda_aware={given})")
    override = read_flag(CUDA_AWARE)
    if override is not None:
        return CudaAwareness(override, f"{CUDA_AWARE.name}={int(override)}")
    return CudaAwareness(library_cuda_support()[0], "")


def library_name() -> str:
    """The MPI library's first line of its version: "Intel(R) MPI Library 2021.18.1 for Linux* OS", say."""
    return MPI.Get_library_version().splitlines()[0].strip()


def is_intel_mpi() -> bool:
    return library_name().startswith("Intel(R) MPI")


def intel_offload_note() -> str:
    """Under Intel MPI, what its GPU offload is set to and what it changes (for every route line); else ""."""
    if not is_intel_mpi():
        return ""
    if intel_mpi_offload_is_on():
        return f"{library_name()}, {INTEL_MPI_OFFLOAD}={intel_mpi_offload()}: it reads device memory itself"
    return (f"{library_name()}, {INTEL_MPI_OFFLOAD} {'=0' if intel_mpi_offload() else 'unset'}: device buffers "
            f"would be staged through the host; {INTEL_MPI_OFFLOAD}=1 lets it read them itself")


def describe_device_path(awareness: CudaAwareness, force_staging: bool) -> str:
    """One line for a log: how device buffers reach this MPI, and why, and what would change it."""
    supported, answer = library_cuda_support()
    why = f"{library_name()}: {answer}" + (f"; {awareness.decided_by}" if awareness.decided_by else "")
    if force_staging:
        return f"device buffers are staged through pinned host memory ({FORCE_STAGING.name}=1; {why})"
    if awareness.aware:
        return f"device buffers go straight to the CUDA-aware MPI ({why})"
    if supported or awareness.decided_by:
        hint = ""
    elif is_intel_mpi():
        hint = (f"; set {INTEL_MPI_OFFLOAD}=1 in mpiexec's environment for Intel MPI to read device memory itself "
                f"(and {INTEL_MPI_CUDA_LIBRARY}=<path> if the CUDA driver's library is not libcuda.so)")
    else:
        hint = f"; set {CUDA_AWARE.name}=1 if your MPI is built with CUDA"
    return f"device buffers are staged through pinned host memory: MPI is not CUDA-aware ({why}{hint})"

"""Whether MPI can read GPU memory, and the host buffers used when it cannot.

A CUDA-aware MPI (most cluster builds of Open MPI, MPICH and Cray MPICH) takes
device pointers directly. Others need every device tensor copied to host memory
first; page-locked ("pinned") host buffers make those copies fast, and keeping
them between steps avoids re-pinning memory on every collective.
"""

import ctypes
import os

import torch
from mpi4py import MPI

CUDA_AWARE_ENV = "FSDP_MPI_CUDA_AWARE"
FORCE_STAGING_ENV = "FSDP_MPI_FORCE_STAGING"

_MPIX_GPU_SUPPORT_CUDA = 0  # MPICH's mpi.h: MPIX_GPU_SUPPORT_CUDA


def env_flag(name: str) -> bool | None:
    """Reads a yes/no environment variable; None when it is unset or empty."""
    value = os.environ.get(name, "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{name}={os.environ[name]!r}: expected 1/0, true/false, yes/no or on/off")


def mpi_is_cuda_aware() -> bool:
    """Asks the MPI library itself whether it accepts CUDA device buffers.

    Open MPI answers through ``MPIX_Query_cuda_support()``, MPICH through
    ``MPIX_GPU_query_support(MPIX_GPU_SUPPORT_CUDA, &flag)``. Libraries with
    neither are taken as not CUDA-aware. ``FSDP_MPI_CUDA_AWARE=0/1`` overrides
    the answer (useful when a library reports support that the job's
    environment disables, e.g. Cray MPICH without ``MPICH_GPU_SUPPORT_ENABLED=1``).
    """
    override = env_flag(CUDA_AWARE_ENV)
    if override is not None:
        return override
    # dlsym on mpi4py's extension module also searches the libmpi it links to.
    library = ctypes.CDLL(MPI.__file__)
    if hasattr(library, "MPIX_GPU_query_support"):
        flag = ctypes.c_int(0)
        status = library.MPIX_GPU_query_support(_MPIX_GPU_SUPPORT_CUDA, ctypes.byref(flag))
        return status == 0 and flag.value == 1
    if hasattr(library, "MPIX_Query_cuda_support"):
        return library.MPIX_Query_cuda_support() == 1
    return False


class HostStagingBuffers:
    """Reusable host buffers, one per named slot, grown on demand and never shrunk.

    Pinned when CUDA is present so that device-to-host copies run at full speed.
    """

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, slot: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Returns a host tensor of exactly `numel` elements of `dtype` for `slot`."""
        nbytes = numel * dtype.itemsize
        buffer = self._buffers.get(slot)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
            self._buffers[slot] = buffer
        return buffer[:nbytes].view(dtype)

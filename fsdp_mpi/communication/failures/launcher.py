"""Starts that cannot work are refused with a message, not left to fail in silence or in a crash.

``srun`` without the process-management interface this MPI was built for (PMI-2
for MPICH's wheel, PMIx for Open MPI's) starts every task as an MPI "singleton":
N independent one-rank trainings that each write their own results and say
nothing. The launcher's own environment tells how many tasks it started;
a world of one rank when the launcher says more is a mismatch.

Intel MPI's GPU offload (``I_MPI_OFFLOAD=1``) on a machine without the CUDA
driver's library makes ``MPI_Init`` itself die of a segmentation fault. That is
checked before fsdp_mpi first imports mpi4py, which starts MPI.
"""

import ctypes
import os

# Environment variables in which launchers announce how many tasks they started.
TASK_COUNT_VARIABLES = (
    "SLURM_STEP_NUM_TASKS",  # srun: the tasks of this job step
    "PMI_SIZE",  # MPICH's Hydra, srun --mpi=pmi2
    "OMPI_COMM_WORLD_SIZE",  # Open MPI's mpiexec
    "PMIX_SIZE",
)


class LauncherMismatchError(RuntimeError):
    """The launcher started several tasks, but MPI put each in a world of its own."""


def check_launcher_agrees(world_size: int) -> None:
    """Raises LauncherMismatchError if a launcher announced more than one task and MPI sees `world_size` == 1."""
    if world_size != 1:  # one rank is what a launcher that MPI does not understand starts each task as
        return
    for variable in TASK_COUNT_VARIABLES:
        value = os.environ.get(variable, "")
        if value.isdigit() and int(value) > 1:
            raise LauncherMismatchError(
                f"the launcher started {value} tasks ({variable}={value}), but MPI sees a world of 1 rank: each "
                f"task would train alone. The launcher and the MPI library do not speak the same process-management "
                f"interface. Use `srun --mpi=pmi2` (MPICH, Cray MPICH), `srun --mpi=pmix` (Open MPI; "
                f"`srun --mpi=list` shows what this SLURM offers), or `mpiexec -n {value}` from the MPI in this "
                f"environment inside the allocation.")


# Intel MPI reads device memory when this is set to anything but 0, through the CUDA driver's library.
INTEL_MPI_OFFLOAD = "I_MPI_OFFLOAD"
INTEL_MPI_CUDA_LIBRARY = "I_MPI_OFFLOAD_CUDA_LIBRARY"


def intel_mpi_offload() -> str:
    """``I_MPI_OFFLOAD``'s value, stripped: "" when unset."""
    return os.environ.get(INTEL_MPI_OFFLOAD, "").strip()


def intel_mpi_offload_is_on() -> bool:
    """Whether the environment asks Intel MPI to read device memory itself (any value but unset and 0)."""
    return intel_mpi_offload() not in ("", "0")


class OffloadWithoutCudaError(RuntimeError):
    """Intel MPI's GPU offload is on where no CUDA driver library loads: MPI_Init would crash."""


def refuse_offload_without_a_cuda_driver() -> None:
    """Raises ``OffloadWithoutCudaError`` if ``I_MPI_OFFLOAD`` is on and the CUDA driver's library (the one
    ``I_MPI_OFFLOAD_CUDA_LIBRARY`` names, else libcuda) does not load: Intel MPI's MPI_Init would end the process
    with a segmentation fault (2021.15 and 2021.18.1 on a machine without a GPU, measured). Nothing to check
    when the variable is unset or 0, whatever the MPI."""
    if not intel_mpi_offload_is_on():
        return
    named = os.environ.get(INTEL_MPI_CUDA_LIBRARY, "").strip()
    for library in [named] if named else ["libcuda.so.1", "libcuda.so"]:
        try:
            ctypes.CDLL(library)
            return
        except OSError:
            continue
    raise OffloadWithoutCudaError(
        f"{INTEL_MPI_OFFLOAD}={os.environ[INTEL_MPI_OFFLOAD]} asks Intel MPI to read GPU memory, but "
        f"{named or 'the CUDA driver (libcuda.so.1)'} does not load here, and MPI would crash as it starts: unset "
        f"{INTEL_MPI_OFFLOAD} on machines without a GPU, or name the driver's library in {INTEL_MPI_CUDA_LIBRARY}")

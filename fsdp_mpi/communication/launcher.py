"""A launcher that started N processes which MPI sees as N separate one-rank worlds is refused.

``srun`` without the process-management interface this MPI was built for (PMI-2
for MPICH's wheel, PMIx for Open MPI's) starts every task as an MPI "singleton":
N independent one-rank trainings that each write their own results and say
nothing. The launcher's own environment tells how many tasks it started;
a world of one rank when the launcher says more is a mismatch.
"""

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
    if world_size != 1:
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

# Sourced by the hpc/ scripts. `launch_ranks COMMAND...` starts COMMAND once per SLURM task, as the
# ranks of one MPI job. How depends on the MPI library; FSDP_MPI_LAUNCHER chooses:
#
#   srun              (default) the site's MPI, built for this SLURM's default process-management interface
#   srun --mpi=pmi2   MPICH from pip, Intel MPI, Cray MPICH (`srun --mpi=list` shows what this SLURM offers)
#   srun --mpi=pmix   Open MPI from pip or a site build, where this SLURM has the pmix plugin
#   mpiexec           the launcher of the MPI in the environment, inside the allocation (pip MPICH or Open MPI)
#   ulfm              Open MPI's mpirun with its fault tolerance (ULFM), over TCP: with the runners' --keep-going,
#                     a rank or node that dies does not end the job, the survivors go on (docs/failures.md)
#
# A launcher that does not match the MPI starts N one-rank jobs; fsdp_mpi refuses to run then and
# names these choices. Under srun a rank that dies ends the step at once (--kill-on-bad-exit), as both
# mpiexecs do, rather than leaving the others to the watchdog's FSDP_MPI_TIMEOUT.

launch_ranks() {
  local launcher="${FSDP_MPI_LAUNCHER:-srun}"
  case "$launcher" in
    ulfm) mpirun --with-ft ulfm --mca btl tcp,self -n "$SLURM_NTASKS" "$@" ;;
    mpiexec*|mpirun*) $launcher -n "$SLURM_NTASKS" "$@" ;;
    *) $launcher --kill-on-bad-exit=1 "$@" ;;
  esac
}

# Sourced by the hpc/run_*.sbatch scripts. `run_resumable COMMAND...` runs an experiment with checkpoints
# and, when it stopped with one (SIGUSR1 from `#SBATCH --signal` before the time limit, or SIGTERM),
# requeues the job: the same job id, script and arguments, resuming in a new allocation.
#
# CHECKPOINT_DIR: where the checkpoints go (default: checkpoints/<job id>, which a requeue keeps). Only
# the fsdp-mpi strategy checkpoints: for the others submit with CHECKPOINT_DIR= (empty) to run without.
# --resume starts fresh while the directory holds no checkpoint, so the first run and every requeued one
# are the same command. Add --checkpoint-every N to the arguments to save also every N optimizer steps,
# in case a node fails (#SBATCH --requeue then requeues the job by itself).

STOPPED_WITH_CHECKPOINT=3                  # the experiments' exit code for it (experiments/training/resume.py)
MAX_REQUEUES="${MAX_REQUEUES:-20}"         # a bound, should each allocation end before the run gets anywhere

run_resumable() {
  local checkpoint_dir="${CHECKPOINT_DIR-checkpoints/$SLURM_JOB_ID}"
  if [ -n "$checkpoint_dir" ]; then
    set -- "$@" --checkpoint-dir "$checkpoint_dir" --resume
  fi
  # SLURM's warning (#SBATCH --signal=B:USR1@...) reaches this shell; pass it, and SIGTERM, to the launcher,
  # which passes it to every rank (srun, MPICH's and Open MPI's mpiexec all do). COMMAND runs in a subshell
  # of its own (launch_ranks is a function): the launcher is that subshell's child.
  "$@" &
  local command_pid=$! status
  trap 'pkill -USR1 -P "$command_pid"' USR1
  trap 'pkill -TERM -P "$command_pid"' TERM
  while :; do
    wait "$command_pid" && status=0 || status=$?   # not set -e's exit: the exit code decides what comes next
    kill -0 "$command_pid" 2>/dev/null || break      # wait also returns when a trapped signal arrives
  done
  trap - USR1 TERM
  if [ "$status" -eq "$STOPPED_WITH_CHECKPOINT" ] && [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_REQUEUES" ]; then
    echo "requeueing job $SLURM_JOB_ID to continue from $checkpoint_dir (restart ${SLURM_RESTART_COUNT:-0})"
    scontrol requeue "$SLURM_JOB_ID"       # allowed by #SBATCH --requeue
    exit 0
  fi
  return "$status"
}

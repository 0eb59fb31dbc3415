# Sourced by the hpc/run_*.sbatch scripts. `run_resumable COMMAND...` runs an experiment with checkpoints
# and, when it stopped with one (SIGUSR1 from `#SBATCH --signal` before the time limit, or SIGTERM),
# requeues the job: the same job id, script and arguments, resuming in a new allocation. When a node of
# the job failed (`#SBATCH --no-kill` keeps the job, on the nodes left), it starts the command again at
# once on those nodes, which resumes from the last checkpoint on fewer ranks.
#
# CHECKPOINT_DIR: where the checkpoints go (default: checkpoints/<job id>, which a requeue keeps). Only
# the fsdp-mpi strategy checkpoints: for the others submit with CHECKPOINT_DIR= (empty) to run without.
# --resume starts fresh while the directory holds no checkpoint, so the first run and every later one
# are the same command. Add --checkpoint-every N to the arguments to save also every N optimizer steps,
# so that a node failure loses at most N steps.

STOPPED_WITH_CHECKPOINT=3                  # the experiments' exit code for it (experiments/training/resume.py)
MAX_REQUEUES="${MAX_REQUEUES:-20}"         # a bound, should each allocation end before the run gets anywhere

run_resumable() {
  local checkpoint_dir="${CHECKPOINT_DIR-checkpoints/$SLURM_JOB_ID}" status nodes left
  local ranks_per_node=$(( ${SLURM_NTASKS:-0} / ${SLURM_JOB_NUM_NODES:-1} ))  # 0: the launcher's default
  if [ -n "$checkpoint_dir" ]; then
    set -- "$@" --checkpoint-dir "$checkpoint_dir" --resume
  fi
  nodes="$(job_nodes)"
  while :; do
    run_passing_signals "$@" && status=0 || status=$?
    [ "$status" -ne 0 ] || break
    left="$(job_nodes)"
    [ -n "$left" ] && [ "$left" != "$nodes" ] || break   # the same nodes: requeue or fail, below
    echo "the job lost node(s): it had $nodes, it has $left; continuing there from $checkpoint_dir"
    use_nodes "$left" "$ranks_per_node"
    nodes="$left"
  done
  if [ "$status" -eq "$STOPPED_WITH_CHECKPOINT" ] && [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_REQUEUES" ]; then
    echo "requeueing job $SLURM_JOB_ID to continue from $checkpoint_dir (restart ${SLURM_RESTART_COUNT:-0})"
    scontrol requeue "$SLURM_JOB_ID"       # allowed by #SBATCH --requeue
    exit 0
  fi
  return "$status"
}

run_passing_signals() {
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
  return "$status"
}

job_nodes() {  # the job's nodes as the controller has them now (a failed node leaves a --no-kill job's list)
  scontrol show job --oneliner "$SLURM_JOB_ID" 2>/dev/null | tr ' ' '\n' | sed -n 's/^NodeList=//p'
}

use_nodes() {  # $1: node list, $2: ranks per node (0: the launcher's default): the allocation srun and mpiexec see
  local count; count="$(scontrol show hostnames "$1" | wc -l)"
  export SLURM_JOB_NODELIST="$1" SLURM_NODELIST="$1" SLURM_JOB_NUM_NODES="$count" SLURM_NNODES="$count"
  if [ "$2" -gt 0 ]; then
    export SLURM_NTASKS=$(($2 * count)) SLURM_NPROCS=$(($2 * count)) SLURM_TASKS_PER_NODE="$2(x$count)"
  fi
}

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
#
# The sbatch scripts run under `set -euo pipefail`: nothing here fails on a controller that does not answer
# for a moment (scontrol is tried again). After a crash the launcher ends within seconds, while the controller
# takes a node out of the job only after SlurmdTimeout: so when a launch failed on the same nodes, the nodes
# are asked to answer (one srun step on each); if one does not, the controller is polled until it drops it.

STOPPED_WITH_CHECKPOINT=3                  # the experiments' exit code for it (fsdp_mpi/loop/stop_signals.py)
MAX_REQUEUES="${MAX_REQUEUES:-20}"         # a bound, should each allocation end before the run gets anywhere
SCONTROL_TRIES="${SCONTROL_TRIES:-5}"      # a failing scontrol is tried this many times,
SCONTROL_RETRY_SECONDS="${SCONTROL_RETRY_SECONDS:-5}"  # this far apart
NODE_ANSWER_SECONDS="${NODE_ANSWER_SECONDS:-60}"       # how long the nodes have to answer after a failed launch
NODE_POLL_SECONDS="${NODE_POLL_SECONDS:-10}"           # how often the controller is asked whether it dropped one
# NODE_LOSS_WAIT: how long to wait for that (default: the controller's SlurmdTimeout and a minute)

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
    left="$(nodes_left "$nodes")"
    [ -n "$left" ] && [ "$left" != "$nodes" ] || break   # the same nodes: requeue or fail, below
    echo "the job lost node(s): it had $nodes, it has $left; continuing there from $checkpoint_dir"
    use_nodes "$left" "$ranks_per_node"
    nodes="$left"
  done
  if [ "$status" -eq "$STOPPED_WITH_CHECKPOINT" ] && [ "${SLURM_RESTART_COUNT:-0}" -lt "$MAX_REQUEUES" ]; then
    echo "requeueing job $SLURM_JOB_ID to continue from $checkpoint_dir (restart ${SLURM_RESTART_COUNT:-0})"
    scontrol_retried requeue "$SLURM_JOB_ID" && exit 0   # allowed by #SBATCH --requeue
    echo "could not requeue job $SLURM_JOB_ID: submit the same script with CHECKPOINT_DIR=$checkpoint_dir" \
         "to continue from its checkpoint" >&2
  fi
  return "$status"
}

run_passing_signals() {
  # SLURM's warning (#SBATCH --signal=B:USR1@...) reaches this shell; pass it, and SIGTERM, to the launcher,
  # which passes it to every rank (srun, MPICH's and Open MPI's mpiexec all do). COMMAND runs in a subshell
  # of its own (launch_ranks is a function): the launcher is that subshell's child.
  "$@" &
  local command_pid=$! status
  SIGNALLED=""
  trap 'SIGNALLED=USR1; pkill -USR1 -P "$command_pid"' USR1
  trap 'SIGNALLED=TERM; pkill -TERM -P "$command_pid"' TERM
  while :; do
    wait "$command_pid" && status=0 || status=$?   # not set -e's exit: the exit code decides what comes next
    kill -0 "$command_pid" 2>/dev/null || break      # wait also returns when a trapped signal arrives
  done
  trap - USR1 TERM
  return "$status"
}

scontrol_retried() {  # scontrol "$@", tried again while it fails (a controller busy or restarting), at most
  local try             # SCONTROL_TRIES times; says so and fails if it never answered
  for ((try = 1; try <= SCONTROL_TRIES; try++)); do
    scontrol "$@" && return 0
    [ "$try" -eq "$SCONTROL_TRIES" ] || sleep "$SCONTROL_RETRY_SECONDS"
  done
  echo "resumable.sh: scontrol $* failed $SCONTROL_TRIES times" >&2
  return 1
}

job_nodes() {  # the job's nodes as the controller has them now (a failed node leaves a --no-kill job's list);
  local job      # nothing if the controller cannot say
  job="$(scontrol_retried show job --oneliner "$SLURM_JOB_ID")" || return 0
  tr ' ' '\n' <<< "$job" | sed -n 's/^NodeList=//p'
}

nodes_left() {  # $1: the job's nodes when a launch failed. The nodes it has now: if the controller still lists
  local left deadline  # them all but one does not answer, once the controller has dropped it (or waited enough).
  left="$(job_nodes)"  # A run stopped by a signal to this script (the time limit's, scancel's) lost no node.
  if [ -n "${SIGNALLED:-}" ] || [ -z "$1" ] || [ "$left" != "$1" ] || all_nodes_answer "$1"; then
    echo "$left"
    return 0
  fi
  deadline=$((SECONDS + $(node_loss_wait)))
  echo "a node of $1 does not answer: waiting until $(date -d "+$((deadline - SECONDS)) seconds" +%T)" \
       "for the controller to take it out of the job" >&2
  while [ "$left" = "$1" ] && [ "$SECONDS" -lt "$deadline" ]; do
    sleep "$NODE_POLL_SECONDS"
    left="$(job_nodes)"
  done
  echo "$left"
}

all_nodes_answer() {  # $1: node list. Whether one step of one task on every node runs, in NODE_ANSWER_SECONDS
  local count; count="$(scontrol_retried show hostnames "$1" | wc -l)" || return 1
  timeout "$NODE_ANSWER_SECONDS" srun --overlap --nodelist="$1" --nodes="$count" --ntasks="$count" \
    --ntasks-per-node=1 true >/dev/null 2>&1
}

node_loss_wait() {  # seconds: NODE_LOSS_WAIT, else the controller's SlurmdTimeout and a minute (default 300 s)
  local timeout
  timeout="$(scontrol_retried show config 2>/dev/null | sed -n 's/^SlurmdTimeout *= *\([0-9]*\).*/\1/p')" || true
  echo "${NODE_LOSS_WAIT:-$(( ${timeout:-300} + 60 ))}"
}

use_nodes() {  # $1: node list, $2: ranks per node (0: the launcher's default): the allocation srun and mpiexec see
  local count; count="$(scontrol_retried show hostnames "$1" | wc -l)"
  export SLURM_JOB_NODELIST="$1" SLURM_NODELIST="$1" SLURM_JOB_NUM_NODES="$count" SLURM_NNODES="$count"
  if [ "$2" -gt 0 ]; then
    export SLURM_NTASKS=$(($2 * count)) SLURM_NPROCS=$(($2 * count)) SLURM_TASKS_PER_NODE="$2(x$count)"
  fi
}

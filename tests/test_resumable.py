"""hpc/resumable.sh's decisions under `set -euo pipefail`, as the sbatch scripts run it, with SLURM's commands
faked (`scontrol` and `srun` on PATH answer from files): a run that lost a node starts again at once on the nodes
left, also when the controller drops the node only a while after the launch ended; a run stopped with a checkpoint
is requeued; a run that failed on all its nodes fails without waiting; a controller that fails to answer now and
then changes none of it. tests/test_cluster.py and tests/test_slurm.py run the same script under a real SLURM."""

import subprocess
import time
from pathlib import Path

import pytest
from mpi_launch import REPO_ROOT

# show job --oneliner ID | show hostnames LIST (comma-separated here) | show config | requeue ID. While the file
# `failures` holds n > 0, a call fails and counts it down (a controller busy for a moment). A job query while
# `drop` holds "NODE k" counts k down, and at 0 takes NODE out of the job: the controller noticing a dead node.
FAKE_SCONTROL = """#!/bin/bash
failures=$(cat "$FAKE_SLURM/failures" 2>/dev/null || echo 0)
if [ "$failures" -gt 0 ]; then echo $((failures - 1)) > "$FAKE_SLURM/failures"; echo "timed out" >&2; exit 1; fi
case "$1 $2" in
  "show job")
    if [ -s "$FAKE_SLURM/drop" ]; then
      read -r node polls < "$FAKE_SLURM/drop"
      if [ "$polls" -le 1 ]; then sed -i "s/,\\?$node//" "$FAKE_SLURM/nodes"; : > "$FAKE_SLURM/drop"
      else echo "$node $((polls - 1))" > "$FAKE_SLURM/drop"; fi
    fi
    echo "JobId=$4 JobName=test NodeList=$(cat "$FAKE_SLURM/nodes") NumNodes=?" ;;
  "show hostnames") tr , '\\n' <<< "$3" ;;
  "show config") echo "SlurmdTimeout           = 1 sec" ;;
  requeue*) echo "$2" >> "$FAKE_SLURM/requeued" ;;
esac
"""
# One task on each node answers unless a node is in the file `dead`.
FAKE_SRUN = """#!/bin/bash
echo "$*" >> "$FAKE_SLURM/probes"
[ ! -s "$FAKE_SLURM/dead" ]
"""

# The run: each attempt logs what it was given, then ends as the test's list of endings says: "STATUS", or
# "STATUS NODE" (NODE left the job first, as SLURM takes a failed node out of a --no-kill job), or "STATUS NODE k"
# (NODE died: it stops answering, and the controller drops it only at its k-th job query after the launch).
JOB = """
set -euo pipefail
source hpc/resumable.sh
attempt() {
  local n; n=$(( $(wc -l < "$FAKE_SLURM/attempts") + 1 ))
  echo "$SLURM_JOB_NODELIST $SLURM_NNODES $SLURM_NTASKS ${SLURM_TASKS_PER_NODE:-} $*" >> "$FAKE_SLURM/attempts"
  read -r ending lost polls <<< "$(sed -n "${n}p" "$FAKE_SLURM/endings")"
  if [ -n "$polls" ]; then echo "$lost" > "$FAKE_SLURM/dead"; echo "$lost $polls" > "$FAKE_SLURM/drop"
  elif [ -n "$lost" ]; then sed -i "s/,\\?$lost//" "$FAKE_SLURM/nodes"; fi
  return "$ending"
}
run_resumable attempt --model tiny && status=0 || status=$?
echo "returned $status"
"""


def run_job(tmp_path: Path, endings: list[str], scontrol_failures: int = 0, **settings) -> tuple[str, list[str], str]:
    """(the script's output, one line per attempt, what was requeued) of a 2-node job of 4 ranks, whose first
    `scontrol_failures` scontrol calls fail; `settings`: more of the script's variables."""
    fake = tmp_path / "slurm"
    (fake / "bin").mkdir(parents=True)
    for name, text in (("scontrol", FAKE_SCONTROL), ("srun", FAKE_SRUN)):
        (fake / "bin" / name).write_text(text)
        (fake / "bin" / name).chmod(0o755)
    (fake / "nodes").write_text("n0,n1\n")
    (fake / "failures").write_text(f"{scontrol_failures}\n")
    (fake / "endings").write_text("\n".join(endings) + "\n")
    (fake / "attempts").write_text("")
    environment = {"PATH": f"{fake / 'bin'}:/usr/bin:/bin", "FAKE_SLURM": str(fake), "SLURM_JOB_ID": "7",
                   "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
                   "SLURM_JOB_NODELIST": "n0,n1", "CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
                   "SCONTROL_RETRY_SECONDS": "0", "NODE_POLL_SECONDS": "0.1", **settings}
    result = subprocess.run(["bash", "-c", JOB], cwd=REPO_ROOT, env=environment, capture_output=True, text=True,
                            timeout=60)
    requeued = (fake / "requeued").read_text() if (fake / "requeued").exists() else ""
    return result.stdout + result.stderr, (fake / "attempts").read_text().splitlines(), requeued


RESUME = "--model tiny --checkpoint-dir {}/checkpoints --resume"


# The ranks left may have been killed with the node's, or have saved on the launcher's SIGTERM (exit 3): either
# way the job goes on where it is, not requeued (a requeued job would wait for the node it lost). The node may
# have left the job when the launcher ends, or (a crash: the controller notices after SlurmdTimeout) a while later.
@pytest.mark.parametrize("ending", ["137 n1", "3 n1", "137 n1 5"])
def test_a_run_that_lost_a_node_starts_again_at_once_on_the_nodes_left(tmp_path, ending):
    output, attempts, requeued = run_job(tmp_path, [ending, "0"])
    resume = RESUME.format(tmp_path)
    assert attempts == [f"n0,n1 2 4  {resume}", f"n0 1 2 2(x1) {resume}"], output
    assert "the job lost node(s): it had n0,n1, it has n0" in output and "returned 0" in output, output
    assert requeued == ""
    assert ("a node of n0,n1 does not answer" in output) == ending.endswith(" 5"), output


def test_a_run_stopped_with_a_checkpoint_on_all_its_nodes_is_requeued(tmp_path):
    output, attempts, requeued = run_job(tmp_path, ["3"])
    assert len(attempts) == 1 and requeued == "7\n" and "requeueing job 7" in output, output
    assert "returned" not in output  # the script ends there: the requeued job runs it again


def test_a_run_that_failed_on_all_its_nodes_fails_at_once(tmp_path):
    """Every node answered: the run failed by itself, and no time goes to waiting for the controller."""
    started = time.monotonic()
    output, attempts, requeued = run_job(tmp_path, ["1"], NODE_LOSS_WAIT="30")
    assert len(attempts) == 1 and requeued == "" and "returned 1" in output, output
    assert "does not answer" not in output and time.monotonic() - started < 15, output


def test_a_dead_node_the_controller_never_drops_fails_the_job_after_the_wait(tmp_path):
    output, attempts, _ = run_job(tmp_path, ["137 n1 1000"], NODE_LOSS_WAIT="1")
    assert len(attempts) == 1 and "a node of n0,n1 does not answer" in output and "returned 137" in output, output


def test_a_controller_that_fails_now_and_then_changes_nothing(tmp_path):
    """Under set -euo pipefail: the start-up's job query, the nodes-left query and the requeue each meet failures
    (4 of 5 tries fail the first), and the job still goes on, then is requeued; a controller that never answers
    the requeue leaves a message saying how to continue, and the run's status."""
    output, attempts, requeued = run_job(tmp_path, ["137 n1", "3"], scontrol_failures=4)
    assert len(attempts) == 2 and "it has n0" in output and requeued == "7\n", output
    output, attempts, requeued = run_job(tmp_path / "never", ["3"], SCONTROL_TRIES="2", scontrol_failures=1000)
    assert len(attempts) == 1 and requeued == "", output
    assert "scontrol requeue 7 failed 2 times" in output and "could not requeue job 7: submit the same" in output
    assert "returned 3" in output, output


@pytest.mark.parametrize("launcher, expected", [
    ("", "srun --kill-on-bad-exit=1 python run.py"),
    ("srun --mpi=pmi2", "srun --mpi=pmi2 --kill-on-bad-exit=1 python run.py"),
    ("mpiexec", "mpiexec -n 4 python run.py"),
    ("ulfm", "mpirun --with-ft ulfm --mca btl tcp,self -n 4 python run.py"),  # what --keep-going needs
])
def test_each_launcher_starts_the_ranks_as_documented(tmp_path, launcher, expected):
    """hpc/launch.sh's FSDP_MPI_LAUNCHER choices, with the launchers faked to print how they were called."""
    for name in ("srun", "mpiexec", "mpirun"):
        (tmp_path / name).write_text(f'#!/bin/bash\necho "{name} $*"\n')
        (tmp_path / name).chmod(0o755)
    environment = {"PATH": f"{tmp_path}:/usr/bin:/bin", "SLURM_NTASKS": "4", "FSDP_MPI_LAUNCHER": launcher}
    result = subprocess.run(["bash", "-c", "set -euo pipefail; source hpc/launch.sh; launch_ranks python run.py"],
                            cwd=REPO_ROOT, env=environment, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == expected, result.stderr

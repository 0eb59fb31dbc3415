"""hpc/resumable.sh's decisions, with SLURM's commands faked (`scontrol` on PATH answers from files): a run that
lost a node starts again at once on the nodes left, a run stopped with a checkpoint is requeued, a run that failed
on all its nodes fails. tests/test_cluster.py and tests/test_slurm.py run the same script under a real SLURM."""

import subprocess
from pathlib import Path

import pytest
from mpi_launch import REPO_ROOT

FAKE_SCONTROL = """#!/bin/bash
# show job --oneliner ID | show hostnames LIST (a comma-separated list here) | requeue ID
case "$1 $2" in
  "show job") echo "JobId=$4 JobName=test NodeList=$(cat "$FAKE_SLURM/nodes") NumNodes=?" ;;
  "show hostnames") tr , '\\n' <<< "$3" ;;
  requeue*) echo "$2" >> "$FAKE_SLURM/requeued" ;;
esac
"""

# The run: each attempt logs what it was given, then ends as the test's list of endings says; an ending of
# "lose n1" takes node n1 out of the job first, as SLURM does to a --no-kill job whose node fails.
JOB = """
source hpc/resumable.sh
attempt() {
  local n; n=$(( $(wc -l < "$FAKE_SLURM/attempts") + 1 ))
  echo "$SLURM_JOB_NODELIST $SLURM_NNODES $SLURM_NTASKS ${SLURM_TASKS_PER_NODE:-} $*" >> "$FAKE_SLURM/attempts"
  read -r ending lost <<< "$(sed -n "${n}p" "$FAKE_SLURM/endings")"
  [ -z "$lost" ] || sed -i "s/,\\?$lost//" "$FAKE_SLURM/nodes"
  return "$ending"
}
run_resumable attempt --model tiny
echo "returned $?"
"""


def run_job(tmp_path: Path, endings: list[str]) -> tuple[str, list[str], str]:
    """(the script's output, one line per attempt, what was requeued) of a 2-node job of 4 ranks."""
    fake = tmp_path / "slurm"
    (fake / "bin").mkdir(parents=True)
    (fake / "bin" / "scontrol").write_text(FAKE_SCONTROL)
    (fake / "bin" / "scontrol").chmod(0o755)
    (fake / "nodes").write_text("n0,n1\n")
    (fake / "endings").write_text("\n".join(endings) + "\n")
    (fake / "attempts").write_text("")
    environment = {"PATH": f"{fake / 'bin'}:/usr/bin:/bin", "FAKE_SLURM": str(fake), "SLURM_JOB_ID": "7",
                   "SLURM_NTASKS": "4", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
                   "SLURM_JOB_NODELIST": "n0,n1", "CHECKPOINT_DIR": str(tmp_path / "checkpoints")}
    result = subprocess.run(["bash", "-c", JOB], cwd=REPO_ROOT, env=environment, capture_output=True, text=True,
                            timeout=60)
    requeued = (fake / "requeued").read_text() if (fake / "requeued").exists() else ""
    return result.stdout + result.stderr, (fake / "attempts").read_text().splitlines(), requeued


# The ranks left may have been killed with the node's, or have saved on the launcher's SIGTERM (exit 3): either
# way the job goes on where it is, not requeued (a requeued job would wait for the node it lost).
@pytest.mark.parametrize("ending", ["137", "3"])
def test_a_run_that_lost_a_node_starts_again_at_once_on_the_nodes_left(tmp_path, ending):
    output, attempts, requeued = run_job(tmp_path, [f"{ending} n1", "0"])
    resume = f"--model tiny --checkpoint-dir {tmp_path / 'checkpoints'} --resume"
    assert attempts == [f"n0,n1 2 4  {resume}", f"n0 1 2 2(x1) {resume}"], output
    assert "the job lost node(s): it had n0,n1, it has n0" in output and "returned 0" in output, output
    assert requeued == ""


def test_a_run_stopped_with_a_checkpoint_on_all_its_nodes_is_requeued(tmp_path):
    output, attempts, requeued = run_job(tmp_path, ["3"])
    assert len(attempts) == 1 and requeued == "7\n" and "requeueing job 7" in output, output
    assert "returned" not in output  # the script ends there: the requeued job runs it again


def test_a_run_that_failed_on_all_its_nodes_fails(tmp_path):
    output, attempts, requeued = run_job(tmp_path, ["1"])
    assert len(attempts) == 1 and requeued == "" and "returned 1" in output, output

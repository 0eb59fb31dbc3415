"""The hpc/ scripts under a real SLURM: one MPI job of the requested size, a refused launcher mismatch, a requeue.

Needs a running SLURM whose jobs may use this checkout and its Python environment
(tests/slurm/start_local_slurm.sh starts a one-node one as root; CI runs it).
Elsewhere these tests skip, saying why.
"""

import csv
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from in_turn import in_turn
from mpi4py import MPI
from mpi_launch import REPO_ROOT
from slurm_jobs import FINISHED, job_id, run_to_end, wait_for, wait_for_end

SHARED_DATA = Path(os.environ.get("FSDP_MPI_DATA_DIR", REPO_ROOT.parent / "shared" / "data"))
TINY_RUN = ["--epochs", "1", "--steps-per-epoch", "3", "--val-steps", "2"]


def slurm_is_up() -> bool:
    if shutil.which("sinfo") is None:
        return False
    answer = subprocess.run(["sinfo", "--noheader", "--states=idle,mix,alloc"], capture_output=True, text=True)
    return answer.returncode == 0 and bool(answer.stdout.strip())


pytestmark = pytest.mark.skipif(not slurm_is_up(), reason="no SLURM answers here (tests/slurm/start_local_slurm.sh "
                                                          "starts a one-node one, as root)")

# mpiexec works inside an allocation with either pip MPI; srun needs the interface the MPI speaks:
# MPICH's wheel speaks PMI-2, Open MPI's wheel PMIx, which Debian's SLURM cannot load.
MPICH = "MPICH" in MPI.Get_library_version()
LAUNCHERS = ["mpiexec"] + (["srun --mpi=pmi2"] if MPICH else [])


@pytest.fixture(scope="module", autouse=True)
def _slurm_in_turn():
    """The cluster's SLURM (test_cluster.py) shares munge with this one: its tests and these take turns."""
    with in_turn():
        yield


def job_environment(launcher: str, **extra: str) -> dict:
    return dict(os.environ, FSDP_MPI_VENV=sys.prefix, FSDP_MPI_LAUNCHER=launcher,
                FSDP_MPI_DATA_DIR=str(SHARED_DATA), **extra)


def submit_and_wait(script: str, tmp_path: Path, *args: str, launcher: str = "mpiexec") -> tuple[int, str]:
    """Submits hpc/<script> with 2 tasks from the repository root; returns its exit status and output."""
    output = tmp_path / "job.out"
    command = ["sbatch", "--parsable", "--ntasks=2", "--cpus-per-task=1", f"--output={output}", f"hpc/{script}",
               *args]
    status, state = run_to_end(subprocess.run(command, cwd=REPO_ROOT, env=job_environment(launcher, CHECKPOINT_DIR=""),
                                              capture_output=True, text=True, timeout=60))
    return status, output.read_text() if output.exists() else f"the job wrote no output: {state}"


def epoch_csvs(results: Path) -> list[Path]:
    """The runs' CSVs of one row per epoch (not their -steps.csv)."""
    return sorted(path for path in results.glob("*.csv") if not path.name.endswith("-steps.csv"))


def world_sizes(results: Path) -> list[int]:
    return [int(row["world_size"]) for path in epoch_csvs(results) for row in csv.DictReader(open(path))]


@pytest.mark.parametrize("script, launcher", [("run_gpt2_cpu.sbatch", launcher) for launcher in LAUNCHERS]
                         + [("run_bert_cpu.sbatch", "mpiexec")])
def test_each_experiment_script_runs_one_job_of_two_ranks(script, launcher, tmp_path):
    results = tmp_path / "results"
    status, output = submit_and_wait(script, tmp_path, *TINY_RUN, "--out-dir", str(results), launcher=launcher)
    assert status == 0, output
    assert world_sizes(results) == [2], output  # one CSV, one epoch, both ranks in it


def test_quickstart_script_trains_on_two_ranks(tmp_path):
    status, output = submit_and_wait("quickstart_cpu.sbatch", tmp_path)
    assert status == 0, output
    assert "2 ranks, " in output and "loss" in output, output


def test_srun_that_does_not_match_the_mpi_is_refused_and_writes_nothing(tmp_path):
    results = tmp_path / "results"
    status, output = submit_and_wait("run_gpt2_cpu.sbatch", tmp_path, *TINY_RUN, "--out-dir", str(results),
                                     launcher="srun")  # this SLURM's default: no PMI at all
    assert status != 0
    assert "the launcher started 2 tasks (SLURM_STEP_NUM_TASKS=2), but MPI sees a world of 1 rank" in output
    assert "srun --mpi=pmi2" in output and "mpiexec -n 2" in output
    assert not results.exists() or not list(results.iterdir())


@pytest.mark.one_mpi  # the sweep's bookkeeping is ours; a launch under each MPI is the one-job test's
def test_sweep_under_salloc_reports_every_run(tmp_path):
    out = tmp_path / "sweep"
    # one strategy: its loop is the rank counts' loop over another list (each strategy's run is the one-job test's)
    env = job_environment("mpiexec", STRATEGIES="fsdp-mpi", RANKS="1 2", SWEEP_OUT=str(out))
    finished = subprocess.run(["salloc", "--ntasks=2", "--cpus-per-task=1", "bash", "-c",
                               f"source {sys.prefix}/bin/activate && bash hpc/sweep.sh cpu {' '.join(TINY_RUN)}"],
                              cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert finished.returncode == 0, finished.stdout + finished.stderr
    assert "failed" not in finished.stdout, finished.stdout
    assert sorted(world_sizes(out)) == [1, 1, 2, 2]  # 2 experiments x 1 and 2 ranks
    assert (out / "report" / "summary.md").exists() and (out / "report" / "loss_curves.png").exists()


def test_a_job_warned_before_its_time_limit_checkpoints_requeues_and_finishes(tmp_path):
    """The warning is sent as `#SBATCH --signal=B:USR1@120` sends it (to the batch script, which passes it
    on), but by `scancel --batch --signal=USR1` once epoch 0 is done: SLURM's own timer is only accurate
    to about a minute.
    The requeued job's two-minute start delay is cut to 3 s so that the test need not wait for it. Epochs of
    100 steps: the warning reaches the run a few steps into epoch 1 (2-10 here), long before that epoch ends.
    """
    results, checkpoints, output = tmp_path / "results", tmp_path / "checkpoints", tmp_path / "job.out"
    job = job_id(subprocess.run(
        ["sbatch", "--parsable", "--ntasks=2", "--cpus-per-task=1", "--time=10", f"--output={output}",
         "hpc/run_gpt2_cpu.sbatch", "--epochs", "2", "--steps-per-epoch", "100", "--batch-size", "4", "--seq-len", "32",
         "--val-steps", "2",
         "--out-dir", str(results)],
        cwd=REPO_ROOT, env=job_environment("mpiexec", CHECKPOINT_DIR=str(checkpoints)),
        capture_output=True, text=True, timeout=60))
    try:
        wait_for(job, lambda state: (output.exists() and "epoch 0:" in output.read_text())
                 or state["JobState"] in FINISHED, 300)
        subprocess.run(["scancel", "--batch", "--signal=USR1", job], check=True)
        wait_for(job, lambda state: state["Restarts"] != "0" or state["JobState"] in FINISHED, 300)
        # Not "now": slurmd refuses a credential issued in the second its predecessor was revoked by the
        # requeue ("Killing non-startable batch job: Job credential revoked"), and the job then fails.
        subprocess.run(["scontrol", "update", f"JobId={job}", "StartTime=now+3"])
        _, state = wait_for_end(job)
    finally:
        subprocess.run(["scancel", job])
    log = output.read_text()
    assert state["JobState"] == "COMPLETED" and state["Restarts"] == "1", (state, log)
    assert "stopped by SIGUSR1 after optimizer step" in log and f"requeueing job {job}" in log, log
    assert "resuming from" in log, log
    epochs = [int(row["epoch"]) for path in epoch_csvs(results) for row in csv.DictReader(open(path))]
    assert sorted(epochs) == [0, 1], log  # one CSV, which the resumed run continued


"""Following a SLURM job from a test: its state as `scontrol show job` tells it, polled until a condition holds.

Polling every half second, not `sbatch --wait`, whose own polling ends a job of 3 s about 10 s after its
submission. Both SLURM test files use it: tests/test_slurm.py with this machine's SLURM, tests/test_cluster.py
with the emulated cluster's (its client commands run on a node).
"""

import subprocess
import time
from collections.abc import Callable

FINISHED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
POLL_SECONDS = 0.5

Client = Callable[..., subprocess.CompletedProcess]  # runs one SLURM client command, its output captured as text


def local_client(*command: str) -> subprocess.CompletedProcess:
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def job_state(job: str, client: Client = local_client) -> dict:
    """The job's fields (JobState, Restarts, ExitCode...), or JobState "not answered" where the controller
    missed the query (seen once right after it started)."""
    shown = client("scontrol", "show", "job", "--oneliner", job)
    state = dict(field.split("=", 1) for field in shown.stdout.split() if "=" in field)
    return state if "JobState" in state else {"JobState": "not answered", "Restarts": "0", "error": shown.stderr}


def wait_for(job: str, done: Callable[[dict], bool], seconds: float, client: Client = local_client) -> dict:
    """The job's state once `done(state)` holds; fails the test with the last state after `seconds`."""
    deadline = time.monotonic() + seconds
    while not done(state := job_state(job, client)):
        assert time.monotonic() < deadline, f"job {job} still {state} after {seconds:.0f} s"
        time.sleep(POLL_SECONDS)
    return state


def job_id(submitted: subprocess.CompletedProcess) -> str:
    """The job of a successful `sbatch --parsable`."""
    assert submitted.returncode == 0, submitted.stderr
    return submitted.stdout.strip().split(";")[0]


def wait_for_end(job: str, seconds: float = 600, client: Client = local_client) -> tuple[int, dict]:
    """The batch script's exit status once the job has ended (-1 where it did not end by itself: cancelled,
    timed out, its node lost), and the job's final state. The caller cancels a job this gave up on."""
    state = wait_for(job, lambda state: state["JobState"] in FINISHED, seconds, client)
    status = int(state["ExitCode"].split(":")[0]) if state["JobState"] in ("COMPLETED", "FAILED") else -1
    return status, state


def run_to_end(submitted: subprocess.CompletedProcess, seconds: float = 600,
               client: Client = local_client) -> tuple[int, dict]:
    """wait_for_end for the job of a `sbatch --parsable`, cancelled if the wait gives up on it."""
    job = job_id(submitted)
    try:
        return wait_for_end(job, seconds, client)
    finally:
        client("scancel", job)

"""Launching test workers under mpiexec from pytest, with a timeout so that a hang fails."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parents[1] / "workers"
REPO_ROOT = Path(__file__).parents[2]


def mpiexec() -> str:
    """``$FSDP_MPI_MPIEXEC`` if set (hpc/gpu_check.sh sets it), else the mpiexec beside this Python (the mpich
    wheel's), else the first on PATH."""
    named = os.environ.get("FSDP_MPI_MPIEXEC", "").strip()
    if named and Path(named).is_file():  # a launcher alone; one with options is for the benchmarks (launch.py)
        return named
    beside_python = Path(sys.executable).parent / "mpiexec"
    found = str(beside_python) if beside_python.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpiexec found: pip install mpich, or load your site's MPI module")
    return found


def child_env(**variables: str) -> dict[str, str]:
    """This process's environment for a launched program: one thread per rank, the checkout first on PYTHONPATH
    and what PYTHONPATH had after it (a cluster's module system, an install under a prefix, as hpc/gpu_check.sh
    makes, put packages there), then `variables`."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **variables}


def run_mpi(worker: str | Path, nprocs: int, *args: str, timeout: float = 240,
            env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs tests/workers/<worker> (or the script at the absolute path `worker`) on `nprocs` ranks in `cwd`
    (with `env` added to the environment); returns the finished process (never raises on failure)."""
    env = child_env(**(env or {}))
    command = [mpiexec(), "-n", str(nprocs), sys.executable, str(WORKERS / worker), *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


class RunFailed(Exception):
    """A launched run ended in error without any failed check: a crash, not a wrong answer."""


# A Python traceback's last line when an `assert` (or torch.testing.assert_close) failed in a rank.
_FAILED_CHECK = re.compile(r"^(\w+\.)*AssertionError\b", re.MULTILINE)


def check_ok(result: subprocess.CompletedProcess) -> None:
    """Passes if the run succeeded. If it did not, fails as an AssertionError when a check inside it failed
    (the test's verdict), or raises RunFailed when it crashed: the mutants count only the first as a kill."""
    if result.returncode == 0:
        return
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    if _FAILED_CHECK.search(result.stderr) or _FAILED_CHECK.search(result.stdout):
        raise AssertionError(f"a check failed in the run: {output}")
    raise RunFailed(output)

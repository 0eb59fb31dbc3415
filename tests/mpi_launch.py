"""Launching test workers under mpiexec from pytest, with a timeout so that a hang fails."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

WORKERS = Path(__file__).parent / "workers"
REPO_ROOT = Path(__file__).parent.parent


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


def run_mpi(worker: str | Path, nprocs: int, *args: str, timeout: float = 240,
            env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs tests/workers/<worker> (or the script at the absolute path `worker`) on `nprocs` ranks in `cwd`
    (with `env` added to the environment); returns the finished process (never raises on failure)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", **(env or {}))
    command = [mpiexec(), "-n", str(nprocs), sys.executable, str(WORKERS / worker), *map(str, args)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


def check_ok(result: subprocess.CompletedProcess) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"

"""Running the experiments' scripts from tests: where they and their data are, a quick CPU configuration, a
launch under mpiexec, and the rows a run wrote."""

import csv
import os
import subprocess
from pathlib import Path

import pytest
from mpi_launch import REPO_ROOT, child_env, mpiexec, python_command

EXPERIMENTS = REPO_ROOT / "experiments"
SHARED_DATA = Path(os.environ.get("FSDP_MPI_DATA_DIR", REPO_ROOT.parent / "shared" / "data"))
needs_data = pytest.mark.skipif(not (SHARED_DATA / "tinyshakespeare").is_dir(), reason=f"no shared data at {SHARED_DATA}")
# On the CPU, also on a machine with a GPU (where --device auto would take it): these tests check CPU runs.
QUICK = ["--device", "cpu", "--epochs", "2", "--steps-per-epoch", "3", "--batch-size", "4", "--seq-len", "32",
         "--val-steps", "2", "--no-progress"]


def launch(script: str, nprocs: int, *args, timeout: float = 300,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Runs experiments/<script> on `nprocs` ranks (with `env` added to the environment)."""
    command = [mpiexec(), "-n", str(nprocs), *python_command(EXPERIMENTS / script), *map(str, args)]
    env = child_env(FSDP_MPI_DATA_DIR=str(SHARED_DATA), **(env or {}))  # after python_command (see run_mpi)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)


def read_rows(out_dir: Path, per: str = "epoch") -> list[dict]:
    """The rows of the one run in `out_dir`: its CSV's, one per epoch, or its -steps.csv's, one per optimizer step."""
    steps = list(out_dir.glob("*-steps.csv"))
    files = steps if per == "step" else [path for path in out_dir.glob("*.csv") if path not in steps]
    assert len(files) == 1, files
    with open(files[0]) as f:
        return list(csv.DictReader(f))

"""Intel MPI from the package index (the impi extra) as the third MPI: a run under it, and the trimmed copy of it
that hpc/trim_impi.sh makes for a GPU machine without a package index, used as hpc/impi_env.sh sets it up. Where
impi-rt is not installed these are deselected (tests/conftest.py); CI's third pass runs them, with the
collectives, the node transport and what depends on the oldest Python (.ci/run)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mpi_launch import REPO_ROOT, check_ok, child_env

pytestmark = pytest.mark.intel_mpi

CARRY_LIMIT = 64 * 2**20  # what one call of a lent GPU machine carries, data and wheels included


def test_a_run_under_intel_mpi_says_so_and_what_its_gpu_offload_would_change():
    result = subprocess.run([str(Path(sys.executable).parent / "mpiexec"), "-n", "2", sys.executable,
                             "experiments/quickstart.py"], cwd=REPO_ROOT, env=child_env(), capture_output=True,
                            text=True, timeout=240)
    check_ok(result)
    assert "Intel(R) MPI Library" in result.stderr
    assert "I_MPI_OFFLOAD unset: device buffers would be staged through the host" in result.stderr
    assert "step    1  loss" in result.stdout


def test_the_trimmed_copy_carries_mpiexec_and_the_library_for_mpi4py_and_is_small(tmp_path):
    """hpc/trim_impi.sh from this environment's Intel MPI, then a 2-rank all-gather through fsdp_mpi with only
    the copy: hpc/impi_env.sh's launcher and library, the copy's own mpiexec (no other MPI on PATH)."""
    copy = tmp_path / "impi"
    made = subprocess.run(["bash", "hpc/trim_impi.sh", sys.prefix, str(copy)], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    check_ok(made)
    archive = copy.with_name("impi.tar.xz")
    assert archive.stat().st_size < CARRY_LIMIT / 4  # room for the data and the other wheels beside it
    assert not any(name.startswith("IMB") for name in os.listdir(copy / "bin"))  # no benchmarks carried
    program = ("import torch, fsdp_mpi; comm = fsdp_mpi.Communicator(); full = torch.empty(4); "
               "comm.all_gather_into(full, torch.full((2,), float(comm.rank))); "
               "from mpi4py import MPI; "
               "seen = comm.all_gather_object((full.tolist(), MPI.Get_library_version().split()[0], "
               "{line.split()[-1] for line in open('/proc/self/maps') if 'libmpi.so' in line})); "
               "comm.rank or print(seen)")
    env = child_env(PATH="/usr/bin:/bin")  # only the copy's mpiexec, from impi_env.sh
    result = subprocess.run(["bash", "-c", f'source hpc/impi_env.sh "{copy}" && mpiexec -n 2 "{sys.executable}" '
                                           f'-c "{program}"'], cwd=REPO_ROOT, env=env, capture_output=True,
                            text=True, timeout=240)
    check_ok(result)
    every_rank = ([0.0, 0.0, 1.0, 1.0], "Intel(R)", {str(copy / "lib" / "libmpi.so.12")})  # the library loaded
    assert result.stdout.strip() == repr([every_rank, every_rank])

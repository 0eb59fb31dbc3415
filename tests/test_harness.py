"""The test harness's own rules (conftest.py), which every other test relies on."""

import os
import subprocess
import sys
from pathlib import Path

from mpi_launch import child_env

STARTS_CUDA = '''
import torch

def test_starts_cuda():
    torch.cuda.is_initialized = lambda: True  # as pinning memory on a machine with a GPU leaves it

def test_after_it():
    pass
'''


def test_a_test_that_starts_cuda_in_pytests_process_is_named(tmp_path):
    """On a GPU machine the next one_rank test's child could not use CUDA: the test that started it fails instead,
    and only that one (CUDA stays started for the rest, which did nothing)."""
    (tmp_path / "test_cuda.py").write_text(STARTS_CUDA)
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env["PYTHONPATH"]])  # conftest.py as a plugin
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rA",
                             "test_cuda.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ERROR at teardown of test_starts_cuda" in result.stdout, result.stdout
    assert "Failed: this test initialised CUDA in pytest's own process" in result.stdout
    assert "2 passed, 1 error" in result.stdout  # the one that started it, not the one after

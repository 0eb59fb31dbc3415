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


PASSES_THEN_FAILS = '''
import os

def test_passes(outcomes_so_far):
    assert "test_mine.py::test_passed_in_an_earlier_run" in outcomes_so_far

def test_passed_in_an_earlier_run():
    pass

def test_fails():
    assert os.environ.get("SECOND_RUN") == "fixed"
'''


def run_pytest_with_conftest(folder: Path, *args: str, **variables: str) -> subprocess.CompletedProcess:
    """pytest in `folder` with this suite's conftest.py as a plugin, so that its rules apply to tests written there."""
    env = child_env(**variables)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env["PYTHONPATH"]])
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rA", *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_a_test_that_starts_cuda_in_pytests_process_is_named(tmp_path):
    """On a GPU machine the next one_rank test's child could not use CUDA: the test that started it fails instead,
    and only that one (CUDA stays started for the rest, which did nothing)."""
    (tmp_path / "test_cuda.py").write_text(STARTS_CUDA)
    result = run_pytest_with_conftest(tmp_path, "test_cuda.py")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ERROR at teardown of test_starts_cuda" in result.stdout, result.stdout
    assert "Failed: this test initialised CUDA in pytest's own process" in result.stdout
    assert "2 passed, 1 error" in result.stdout  # the one that started it, not the one after


def test_a_run_cut_short_goes_on_with_the_tests_that_had_not_passed(tmp_path):
    """FSDP_MPI_TESTS_PASSED: a run adds each test that passes to the file, and a later run on the same code
    leaves out those already there, and counts them as passed (for the mutants that name them)."""
    (tmp_path / "test_mine.py").write_text(PASSES_THEN_FAILS)
    passed = tmp_path / "passed.txt"
    passed.write_text("test_mine.py::test_passed_in_an_earlier_run\n")  # as a cut run of the same code left it
    first = run_pytest_with_conftest(tmp_path, "test_mine.py", FSDP_MPI_TESTS_PASSED=str(passed))
    assert "1 failed, 1 passed, 1 deselected" in first.stdout, first.stdout + first.stderr
    earlier, passes = "test_mine.py::test_passed_in_an_earlier_run", "test_mine.py::test_passes"
    assert passed.read_text().splitlines() == [earlier, passes]
    second = run_pytest_with_conftest(tmp_path, "test_mine.py", FSDP_MPI_TESTS_PASSED=str(passed), SECOND_RUN="fixed")
    assert "1 passed, 2 deselected" in second.stdout, second.stdout + second.stderr
    assert passed.read_text().splitlines()[2:] == ["test_mine.py::test_fails"]

"""A failing rank ends the job promptly; bad multi-rank input fails on every rank with a clear message."""

import time

from mpi_launch import run_mpi


def test_a_rank_that_raises_aborts_the_whole_job_within_seconds():
    start = time.monotonic()
    result = run_mpi("failure.py", 3, "-", timeout=120)
    elapsed = time.monotonic() - start
    assert result.returncode != 0
    assert "injected failure on rank 1" in result.stderr
    assert "the job should have been aborted" not in result.stderr
    assert elapsed < 60, f"took {elapsed:.0f} s"


def test_different_models_on_different_ranks_are_refused_at_wrap_time():
    result = run_mpi("bad_models.py", 2, "-", "different_models", timeout=120)
    assert result.returncode != 0
    assert "ranks [1] hold a different model than rank 0" in result.stderr


def test_a_wrap_policy_that_splits_tied_weights_is_refused():
    result = run_mpi("bad_models.py", 2, "-", "tied_split", timeout=120)
    assert result.returncode != 0
    assert "shared (tied) parameters must belong to one unit" in result.stderr

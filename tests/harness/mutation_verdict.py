"""A pytest plugin for the mutants' runs (test_mutants.py, ``-p mutation_verdict``).

It stops the run at the first test whose own check failed (an AssertionError from the test or, through
``check_ok`` and conftest's one-rank child, from a rank; or pytest's Failed, as from ``pytest.raises``
when nothing was raised) and writes that test's id to the file named by
``$FSDP_MPI_MUTANT_VERDICT``. Only that counts as a kill: an error, a crash, a skip or a timeout says that
the mutant broke something, not that a test noticed what it broke.
"""

import os

import pytest

VERDICT_ENV = "FSDP_MPI_MUTANT_VERDICT"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    checked = call.excinfo is not None and call.excinfo.errisinstance((AssertionError, pytest.fail.Exception))
    if call.when == "call" and outcome.get_result().failed and checked:
        with open(os.environ[VERDICT_ENV], "a") as verdict:
            verdict.write(f"{item.nodeid}\n")
        item.session.shouldstop = "a check failed: the mutant is killed"

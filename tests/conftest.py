import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import mpi4py
import pytest

# One OpenMP thread in pytest's own process: GNU OpenMP's thread pool does not survive fork(), and a
# one_rank test's child would hang in its first parallel torch operation (workers set their own threads).
os.environ["OMP_NUM_THREADS"] = "1"

# pytest's own process never initialises MPI: a process that has cannot always launch mpiexec (Open MPI).
# Multi-rank tests run under mpiexec; a one-rank test that needs MPI is marked `one_rank` and gets it in a child.
mpi4py.rc.initialize = False
mpi4py.rc.finalize = False

# Tests import the mpiexec launcher, and the experiments' modules as the scripts do (top level).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "experiments"))

# Tests marked `one_mpi` check fsdp_mpi's own logic, not the MPI library under it (the mutants, evaluation, the
# cost model, the benchmarks, the experiments' bookkeeping beyond a real run of each): CI runs the whole suite
# under its first MPI and, with FSDP_MPI_SECOND_MPI=1, the rest again under its second.
SECOND_MPI_ENV = "FSDP_MPI_SECOND_MPI"


def pytest_collection_modifyitems(config, items):
    if os.environ.get(SECOND_MPI_ENV) != "1":
        return
    once = {item for item in items if item.get_closest_marker("one_mpi")}
    config.hook.pytest_deselected(items=list(once))
    items[:] = [item for item in items if item not in once]

# Where every test must run (CI: data, MPI and transformers are installed), a skip is a failure,
# except for tests that need hardware this machine lacks.
MAY_SKIP_ANYWHERE = ("needs a CUDA device",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("FSDP_MPI_STRICT_SKIPS") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(allowed in reason for allowed in MAY_SKIP_ANYWHERE):
            report.outcome = "failed"
            report.longrepr = f"skipped where every test must run (FSDP_MPI_STRICT_SKIPS=1): {reason}"


ONE_RANK_TIMEOUT_SECONDS = 300


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Runs a test marked `one_rank` in a forked child that initialises MPI as a world of one rank.

    Fixtures are set up in pytest's process (so they must not use MPI); the test body runs in the child,
    which writes its traceback, if any, to a file. A child that does not end in time is killed and fails.
    """
    if not pyfuncitem.get_closest_marker("one_rank"):
        return None
    with tempfile.NamedTemporaryFile(mode="r", suffix=".traceback") as report:
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                from mpi4py import MPI
                MPI.Init_thread(MPI.THREAD_MULTIPLE)
                pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames})
            except BaseException:
                status = 1
                with open(report.name, "w") as out:
                    out.write(traceback.format_exc())
            os._exit(status)
        deadline = time.monotonic() + ONE_RANK_TIMEOUT_SECONDS
        while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(f"the test's child process did not end within {ONE_RANK_TIMEOUT_SECONDS} s", pytrace=False)
            time.sleep(0.05)
        if ended[1] != 0:
            failure = report.read() or f"it ended with wait status {ended[1]}"
            pytest.fail(f"in the test's child process:\n{failure}", pytrace=False)
    return True


def pytest_sessionfinish(session, exitstatus):
    from mpi4py import MPI
    if MPI.Is_initialized():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("\nMPI was initialised in pytest's own process: mark the test that needs it `one_rank`", file=sys.stderr)

import os
import sys
import traceback
from pathlib import Path

import mpi4py
import pytest

# pytest's own process never initialises MPI: a process that has cannot always launch mpiexec (Open MPI).
# Multi-rank tests run under mpiexec; a one-rank test that needs MPI is marked `one_rank` and gets it in a child.
mpi4py.rc.initialize = False
mpi4py.rc.finalize = False

# Tests import the mpiexec launcher, and the experiments' modules as the scripts do (top level).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "experiments"))

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


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Runs a test marked `one_rank` in a forked child that initialises MPI as a world of one rank.

    Fixtures are set up in pytest's process (so they must not use MPI); the test body runs in the child.
    """
    if not pyfuncitem.get_closest_marker("one_rank"):
        return None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_end)
        failure = b""
        try:
            from mpi4py import MPI
            MPI.Init_thread(MPI.THREAD_MULTIPLE)
            pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames})
        except BaseException:
            failure = traceback.format_exc().encode()
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(failure)
        os._exit(1 if failure else 0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as pipe:
        failure = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    if status != 0:
        pytest.fail(f"in the test's child process:\n{failure or f'it ended with wait status {status}'}", pytrace=False)
    return True


def pytest_sessionfinish(session, exitstatus):
    from mpi4py import MPI
    if MPI.Is_initialized():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("\nMPI was initialised in pytest's own process: mark the test that needs it `one_rank`", file=sys.stderr)

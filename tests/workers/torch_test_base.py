"""torch's own tests of a process-group backend, ``DistributedTest._DistTestBase`` (it ships in the torch wheel),
on every rank of one MPI job, all ranks running the same tests in the same order, as torch ran them for its MPI
backend.

    mpiexec -n N python torch_test_base.py BACKEND TEMP_DIR OUT [--from TEST] [TEST ...]

torch decides at import which tests a backend gets, by its name. Here the module is imported twice, as for
torch's MPI backend and as for gloo, and a test runs if either opens it (its ``BACKEND``, inside the test, is
that gate's name): every CPU test torch runs for its MPI backend or for gloo. Whatever those names ask for, in
``init_process_group`` or ``new_group``, is BACKEND here: fsdp_mpi, or gloo itself for comparison. TESTS (regular
expressions, each matching whole names) narrow the run, ``--from`` starts it at one (after a test that hung, in a fresh job:
test_torch_test_base.py); the skips of ``torch_test_base_skips.py`` apply either way. Rank 0 writes the plan, the
tests in order, to OUT.plan; each rank appends a JSON line to OUT.<rank> as each test starts and as it ends, so a
run cut short still says what passed, and which test it was in.
"""

import importlib.util
import json
import os
import re
import sys
import time
import traceback
import unittest

from mpi4py import MPI

BACKEND, TEMP_DIR, OUT = sys.argv[1:4]
FIRST = sys.argv[5] if sys.argv[4:5] == ["--from"] else None
CHOSEN = set(sys.argv[6:] if FIRST else sys.argv[4:])
RANK, WORLD = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
INIT_FILE = os.path.join(TEMP_DIR, "init-file")
os.environ.update(WORLD_SIZE=str(WORLD), TEMP_DIR=TEMP_DIR, INIT_METHOD=f"file://{INIT_FILE}")

import torch.distributed as dist  # noqa: E402
from torch.testing._internal.common_distributed import TEST_SKIPS  # noqa: E402
from torch.testing._internal.common_utils import TestCase  # noqa: E402
from torch_test_base_skips import skipped_here  # noqa: E402

import fsdp_mpi.distributed  # noqa: E402

GATES = ("mpi", "gloo")  # the backends whose test sets are opened, the first that opens a test taking it
SKIP_EXIT_CODES = {skip.exit_code: skip.message for skip in TEST_SKIPS.values()}  # torch's skips inside a test


def imported_as(gate: str):
    """torch's test module, imported afresh with ``BACKEND`` set to `gate` (its decorators read it)."""
    os.environ["BACKEND"] = gate
    found = importlib.util.find_spec("torch.testing._internal.distributed.distributed_test")
    spec = importlib.util.spec_from_file_location(f"distributed_test_as_{gate}", found.origin)
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # its classes pickle by this name
    spec.loader.exec_module(module)
    return module


def backend_for(name) -> str:
    """The backend that a gate's name (or the default, None) stands for."""
    return BACKEND if name is None or str(name).lower() in GATES else name


def open_to_the_backend() -> None:
    """``init_process_group`` and ``new_group`` called with a gate's name create BACKEND's groups; a default group
    made without an address comes from MPI (fsdp_mpi's own start) or, for gloo, from a file store."""
    init, new_group = dist.init_process_group, dist.new_group

    def init_process_group(backend=None, **kwargs):
        if kwargs.get("init_method") is None and kwargs.get("store") is None:
            if BACKEND == "fsdp_mpi":
                return fsdp_mpi.distributed.init_process_group(timeout=kwargs.get("timeout"))
            kwargs.update(init_method=f"file://{INIT_FILE}-{time.monotonic_ns()}", rank=RANK, world_size=WORLD)
            kwargs["init_method"] = MPI.COMM_WORLD.bcast(kwargs["init_method"])  # one file for all ranks
        return init(backend_for(backend), **kwargs)

    def new_group_of(*args, backend=None, **kwargs):
        return new_group(*args, backend=None if backend is None else backend_for(backend), **kwargs)
    dist.init_process_group, dist.new_group = init_process_group, new_group_of


def test_class(module):
    class TorchTestBase(TestCase, module.DistributedTest._DistTestBase):
        rank, world_size, file_name = RANK, str(WORLD), INIT_FILE
    return TorchTestBase


class Recorder(unittest.TestResult):
    """Writes each test's outcome as a JSON line; torch's skips from inside a test (an exit code) are skips."""

    def __init__(self, out):
        super().__init__()
        self.out, self.started, self.gate = out, 0.0, ""

    def _write(self, test, outcome, detail=""):
        self.out.write(json.dumps({"test": test._testMethodName, "outcome": outcome, "gate": self.gate,
                                   "detail": detail[-3000:],
                                   "seconds": round(time.perf_counter() - self.started, 2)}) + "\n")
        self.out.flush()

    def startTest(self, test):
        super().startTest(test)
        self.started = time.perf_counter()
        self._write(test, "started")

    def addSuccess(self, test):
        self._write(test, "passed")

    def addSkip(self, test, reason):
        self._write(test, "skipped", reason)

    def addFailure(self, test, err):
        self._write(test, "failed", "".join(traceback.format_exception(*err)))

    def addError(self, test, err):
        if err[0] is SystemExit and err[1].code in SKIP_EXIT_CODES:
            self._write(test, "skipped", SKIP_EXIT_CODES[err[1].code])
        else:
            self._write(test, "error", "".join(traceback.format_exception(*err)))

    def addExpectedFailure(self, test, err):
        self._write(test, "passed", "an expected failure")

    def addUnexpectedSuccess(self, test):
        self._write(test, "failed", "an unexpected success")


def skip_reason(method) -> str | None:
    return getattr(method, "__unittest_skip_why__", None) if getattr(method, "__unittest_skip__", False) else None


def fresh_barrier(module) -> None:
    """torch's file barrier between the ranks, begun afresh before each test."""
    module.Barrier.barrier_id = 0
    barriers = os.path.join(TEMP_DIR, "barrier")
    MPI.COMM_WORLD.Barrier()  # every rank is past the last test's own barrier before its files go
    if RANK == 0:
        for stale in os.listdir(barriers):
            os.unlink(os.path.join(barriers, stale))
    MPI.COMM_WORLD.Barrier()


_STARTED: list = []  # the default group this runner made last


def fresh_default_group() -> None:
    """The runner's own default group for the next test, made afresh where the last test left none (it failed
    after destroying it), one of its own (made with its own timeout), or a failed one (given up at its timeout):
    torch starts each test in fresh processes."""
    started = _STARTED[-1] if _STARTED else None
    failed = bool(getattr(getattr(started, "failed", None), "reason", ""))
    stale = not dist.is_initialized() or dist.group.WORLD is not started or failed
    if MPI.COMM_WORLD.allreduce(stale, op=MPI.LOR):
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group()
        _STARTED[:] = [dist.group.WORLD]


def main() -> None:
    for folder in ("barrier", "test_dir", "init_dir"):  # what torch's own harness makes for each test
        os.makedirs(os.path.join(TEMP_DIR, folder), exist_ok=True)
    modules = {gate: imported_as(gate) for gate in GATES}
    classes = {gate: test_class(module) for gate, module in modules.items()}
    open_to_the_backend()
    names = sorted(set().union(*(unittest.TestLoader().getTestCaseNames(c) for c in classes.values())))
    names = [name for name in names if not CHOSEN or any(re.fullmatch(pattern, name) for pattern in CHOSEN)]
    if RANK == 0:
        with open(f"{OUT}.plan", "w") as plan:
            json.dump(names, plan)
    with open(f"{OUT}.{RANK}", "a") as out:
        result = Recorder(out)
        for name in names[names.index(FIRST) if FIRST else 0:]:
            reasons = {gate: skip_reason(getattr(classes[gate], name)) for gate in GATES}
            gate = next((gate for gate in GATES if reasons[gate] is None), None)
            case = classes[gate or GATES[0]](name)
            result.gate = gate or "closed"
            ours = skipped_here(name, BACKEND)
            if gate is None or ours is not None:  # closed to both backends by torch, or skipped by us
                result.startTest(case)
                result.addSkip(case, f"here: {ours}" if ours else reasons[GATES[0]])
                continue
            os.environ["BACKEND"] = modules[gate].BACKEND = gate  # what the test reads at run time
            fresh_barrier(modules[gate])
            fresh_default_group()

            case.run(result)
    MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main()

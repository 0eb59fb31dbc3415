"""``MpiWork``: what the backend hands torch for each call, completed by a future that carries the call's result
or its error, and waited for at most the group's timeout.

Every call of a torch group completes on its communicator's communication thread (``process_group.py``): a
collective runs there; a message, started at once, is finished there when waited for (MPI completes it then,
``point_to_point.py``), after whatever the group started before it. Either way the work's future gets the result,
or the exception the call raised, named after the call, so that ``wait()`` raises there and not later in an
unrelated collective. On a GPU the future is torch's device-aware one: waiting makes the caller's stream wait for
the call's work.

``wait()`` waits at most the group's timeout (its ``timeout=``), then raises torch's ``DistBackendError`` with the
rank's last calls, as gloo raises. MPI cannot cancel the call: the group is failed from then on and raises at once
(``GroupFailed``), and the process, whose communication thread is still inside MPI, cannot finalize MPI: at its
exit it ends the job instead (``MPI_Abort``), saying why. A receive from any rank says where it came from
(``_source_rank``).
"""

import atexit
import sys
import threading
from typing import Callable

import torch
import torch.distributed as dist
from torch.futures import Future

from fsdp_mpi.communication.failures.abort import abort_job
from fsdp_mpi.communication.failures.collective_log import PROCESS_LOG

_GIVEN_UP: list[str] = []  # the calls this process gave up on: still inside MPI


class GroupFailed:
    """Whether a group has given up on a call at its timeout, and which: shared by the group's works."""

    def __init__(self):
        self.reason = ""

    def give_up(self, reason: str) -> None:
        self.reason = reason
        if not _GIVEN_UP:
            atexit.register(_end_the_job)  # runs before mpi4py's MPI_Finalize, registered earlier
        _GIVEN_UP.append(reason)

    def check(self) -> None:
        if self.reason:
            raise dist.DistBackendError(f"fsdp_mpi: this group gave up on an earlier call ({self.reason}), which "
                                        f"MPI cannot cancel: destroy the group (or end the job)")


def _end_the_job() -> None:
    abort_job(f"fsdp_mpi: this process gave up on {', '.join(_GIVEN_UP)} at the group's timeout; MPI cannot cancel "
              f"a call, and cannot be finalized while one is inside it: the job ends here")


def _add_note(error: Exception, note: str) -> None:
    """`note` printed after `error`'s message: Python 3.11's ``add_note``; on 3.10, which has none, appended to
    the message where that is the error's first argument (what str() and a traceback print)."""
    if sys.version_info >= (3, 11):
        error.add_note(note)
    elif error.args and isinstance(error.args[0], str):
        error.args = (f"{error.args[0]}\n{note}", *error.args[1:])


class MpiWork(dist.Work):
    """A call's handle: ``wait()`` returns once it has completed, or raises its error, or its timeout."""

    def __init__(self, device: torch.device, result, name: str, limit: float, failed: GroupFailed,
                 finish: Callable[[], int | None] | None = None, start=None):
        super().__init__()
        self._future = Future(devices=[device]) if device.type == "cuda" else Future()
        self._done = threading.Event()
        self._result, self._name, self._limit, self._failed = result, name, limit, failed
        self._finish, self._start, self._source = finish, start, None

    def run(self, call: Callable[[], object]) -> None:
        """Runs `call` (the collective, or a message's finish), then completes the work with its result or its
        error, named; a message's finish returns the rank it came from."""
        try:
            self._source = call()
        except Exception as error:  # noqa: BLE001 (handed to whoever waits)
            _add_note(error, f"fsdp_mpi: raised by {self._name}")
            self._future.set_exception(error)
        else:
            self._future.set_result(self._result)
        self._done.set()

    def wait(self, timeout=None) -> bool:
        if self._finish is not None:  # a message: finished on the communication thread, after what came before
            finish, self._finish = self._finish, None
            self._start(lambda: self.run(finish))
        if not self._done.wait(self._limit if self._limit > 0 else None):
            self._failed.give_up(f"{self._name}, not done after {self._limit:g} s")
            raise dist.DistBackendError(
                f"fsdp_mpi: {self._name} Timed out after {self._limit:g} s (the group's timeout=): another rank "
                f"has not joined it. Last calls on this rank, oldest first:\n{PROCESS_LOG.recent()}")
        self._future.wait()  # raises the call's error
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self.is_completed() and self.exception() is None

    def exception(self):
        if not self.is_completed():
            return None
        try:
            self._future.value()
        except Exception as error:  # noqa: BLE001
            return error
        return None

    def get_future(self) -> Future:
        return self._future

    def _source_rank(self) -> int:
        if self._source is None:
            raise RuntimeError("fsdp_mpi: the source rank is known once a receive from any rank has completed")
        return self._source

    def result(self):
        return self._result

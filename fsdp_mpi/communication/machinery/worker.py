"""A communication thread per communicator, so that a staged collective started early runs behind compute.

A staged collective (``staged.py``) is host work: copy chunks out, call MPI,
copy chunks back. Started on the main thread it would run to its end before the
main thread could queue the next kernel, so a prefetch or an asynchronous
reduce-scatter on that path would overlap nothing. Here ``start()`` hands the
whole collective to one worker thread and returns; MPI and the copies run while
the main thread goes on queueing compute (mpi4py and torch release the GIL
inside their calls); ``wait()`` on the returned handle joins it.

The ranks must still enter every collective of a communicator in the same
order. The worker runs its collectives first come, first served, and a
collective called on the main thread first waits for everything handed to the
worker (``wait_for_all()``, which the ``Communicator`` calls before each of its
collectives). So each rank issues its collectives in program order, whichever
thread issues them.
Two threads may then be inside MPI at once only on different communicators
(a replica all-reduce beside a shard group's prefetch), which MPI allows at
``MPI_THREAD_MULTIPLE``; where the library gives less, nothing is handed over and
a started staged collective completes before ``start()`` returns, as before.

The worker is a daemon thread: a collective whose partners never come (one a torch
group has given up on at its timeout, ``distributed/work.py``) keeps it inside MPI,
and must not keep the process from exiting. But a worker still running a call when
the interpreter finalizes is ended by Python as it takes the GIL back, and ending a
thread inside torch's C++ (completing a torch future, as the torch backend's calls
do) aborts the process ("terminate called without an active exception"). So at exit,
before MPI is finalized, each worker first finishes what it was handed, for at most
``EXIT_WAIT_SECONDS`` in all.
"""

import atexit
import queue
import threading
import time
import weakref
from concurrent.futures import Future, wait
from typing import Callable

import torch
from mpi4py import MPI

from fsdp_mpi.communication.machinery.in_flight import InFlight


EXIT_WAIT_SECONDS = 10.0
_WORKING: "weakref.WeakSet[CommunicationThread]" = weakref.WeakSet()  # those whose worker has started


def _finish_before_exit() -> None:
    """At exit (before mpi4py's MPI_Finalize, registered earlier): every worker's calls completed, within
    ``EXIT_WAIT_SECONDS`` (a call that never completes is one a torch group gave up on, and that group's own
    exit handler, registered later and so run first, has ended the job)."""
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    for thread in list(_WORKING):
        wait(thread._queued, timeout=max(0.0, deadline - time.monotonic()))


def threads_may_call_mpi_at_once() -> bool:
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


class CommunicationThread:
    """Runs the collectives handed to it one at a time, in order, on a worker thread started on first use.

    On a GPU the worker queues its device work (staging copies, casts) on a side
    stream of its own, which first waits for what the caller's stream had queued
    when the collective was started, and no longer: compute queued after that
    runs beside the collective. Waiting for the collective makes the caller's
    stream wait for the side stream's work.
    """

    def __init__(self):
        self._jobs: queue.SimpleQueue | None = None
        self._worker: threading.Thread | None = None
        self._queued: list[Future] = []
        self._side_streams: dict[torch.device, "torch.cuda.Stream"] = {}

    def start(self, collective: Callable[[], None], device: torch.device, keep: tuple = ()) -> InFlight:
        """Queues `collective` (`keep`: its buffers, held until it is waited for); the returned ``wait()``
        completes it and every one queued before it, and on a GPU makes the caller's stream wait for its work."""
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            self._worker = threading.Thread(target=self._serve, name="fsdp_mpi communication", daemon=True)
            self._worker.start()
            if not _WORKING:
                atexit.register(_finish_before_exit)
            _WORKING.add(self)
        caller_stream = ready = side = None
        if device.type == "cuda":
            caller_stream = torch.cuda.current_stream(device)
            ready = torch.cuda.Event()
            ready.record(caller_stream)
            if device not in self._side_streams:  # made once: each new stream takes the next of torch's pool
                self._side_streams[device] = torch.cuda.Stream(device)
            side = self._side_streams[device]
        # done ones leave the queue, unless they failed: wait_for_all() re-raises that
        self._queued = [future for future in self._queued if not future.done() or future.exception() is not None]
        future = Future()
        self._jobs.put((future, collective, ready, side))
        self._queued.append(future)

        def joined() -> None:
            done = future.result()
            if done is not None:
                caller_stream.wait_event(done)
        return InFlight(steps=(joined,), keep=keep)

    def _serve(self) -> None:
        """The worker: runs what it is handed, one at a time, in order, for as long as the process lives."""
        while True:
            future, collective, ready, side = self._jobs.get()
            try:
                future.set_result(self._run(collective, ready, side))
            except BaseException as error:  # noqa: BLE001 (handed to whoever waits)
                future.set_exception(error)

    def _run(self, collective: Callable[[], None], ready, side):
        if side is None:
            collective()
            return None
        # The worker's current GPU is the stream's: otherwise it is GPU 0, and leaving the stream context would
        # make CUDA create a context there, on another rank's GPU.
        with torch.cuda.device(side.device), torch.cuda.stream(side):
            side.wait_event(ready)
            collective()
            done = torch.cuda.Event()
            done.record(side)
        return done

    def wait_for_all(self) -> None:
        """Completes every collective queued so far, then re-raises the first error one raised; a no-op on the
        worker. It waits for all of them even after an error, so that no collective of this communicator can
        start on the main thread while the worker is still inside one."""
        if not self._queued or threading.current_thread() is self._worker:
            return
        queued, self._queued = self._queued, []
        wait(queued)
        for future in queued:
            future.result()

"""What each rank is doing in MPI: a log of its recent collectives, and a watchdog for the one it is stuck in.

A job whose ranks diverge (one runs an extra step, skips a unit, or has
finished) does not fail: the ranks still inside a collective wait for partners
that never come. So every collective of a ``Communicator`` is recorded here
(sequence number, operation, unit, size, times) in a small ring buffer, and a
rank blocked in one collective longer than its timeout prints what it is
waiting in and what came before, then aborts the whole job.

The watchdog is one daemon thread per process, started with the first
collective that has a timeout. mpi4py releases the GIL inside blocking MPI
calls, so the thread runs while the main thread waits. It also answers other
ranks' "are you there?" and, shortly before its own timeout, asks them
(``liveness.py``), so that its report names the ranks and hosts that fell silent.
"""

import atexit
import socket
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass

from mpi4py import MPI

from fsdp_mpi.communication.failures.abort import abort_job
from fsdp_mpi.communication.failures.liveness import Liveness
from fsdp_mpi.communication.settings import TIMEOUT, VERIFY
from fsdp_mpi.communication.timing_points import collective_started

RECORDS_KEPT = 32  # per process; the watchdog prints the last RECORDS_PRINTED of them
RECORDS_PRINTED = 12
ASKING_SECONDS = 2.0  # before the timeout, at most a quarter of it: the time other ranks get to answer


@dataclass(slots=True)
class CollectiveRecord:
    """One collective as this rank entered it; the same `sequence` on every rank of the communicator."""

    sequence: int  # collectives started on this communicator before this one
    operation: str  # all_gather, reduce_scatter, broadcast, all_reduce_sum, ...
    unit: str  # the module path of the unit it serves ("<root>" for the top), "" if it serves none
    numel: int  # elements this rank sends (0 for pickled objects)
    dtype: str
    started: float  # time.monotonic()
    finished: float | None = None

    def describe(self) -> str:
        unit = f" of unit '{self.unit}'" if self.unit else ""
        size = f", sending {self.numel:,} {self.dtype}" if self.dtype else ""
        return f"#{self.sequence} {self.operation}{unit}{size}"

    def fingerprint(self) -> str:
        """What every rank must agree on when entering this collective (verify mode)."""
        return f"{self.sequence}|{self.operation}|{self.unit}|{self.numel}|{self.dtype}"


class CollectiveLog:
    """This process's last collectives, and the one (if any) it is blocked in now."""

    def __init__(self, capacity: int = RECORDS_KEPT):
        self.records: deque[CollectiveRecord] = deque(maxlen=capacity)
        # Per thread (the main one, a communication thread): (record, since, timeout, rank) while blocked.
        self.blocked: dict[int, tuple[CollectiveRecord, float, float, int]] = {}
        self._watchdog: threading.Thread | None = None
        self._lock = threading.Lock()
        self.liveness: Liveness | None = None  # set by the first world Communicator, where threads may call MPI

    def begin(self, sequence: int, operation: str, unit: str, numel: int, dtype: str) -> CollectiveRecord:
        record = CollectiveRecord(sequence, operation, unit, numel, dtype, time.monotonic())
        self.records.append(record)
        collective_started(record)
        return record

    def enter(self, record: CollectiveRecord, timeout: float, rank: int) -> None:
        """Marks this thread as waiting in `record` (watched if `timeout` > 0) until ``leave``."""
        if timeout > 0:
            self._start_watchdog()
        self.blocked[threading.get_ident()] = (record, time.monotonic(), timeout, rank)

    def leave(self, record: CollectiveRecord, finishes: bool = True) -> None:
        """This thread no longer waits; `finishes` stamps the record's end time."""
        del self.blocked[threading.get_ident()]
        if finishes:
            record.finished = time.monotonic()

    @contextmanager
    def blocking(self, record: CollectiveRecord, timeout: float, rank: int, finishes: bool = True):
        """``enter`` and ``leave`` around a block."""
        self.enter(record, timeout, rank)
        try:
            yield
        finally:
            self.leave(record, finishes)

    def recent(self, count: int = RECORDS_PRINTED) -> str:
        """The last `count` collectives, oldest first, one per line, with how long each took."""
        now = time.monotonic()
        lines = []
        for record in list(self.records)[-count:]:
            took = (f"took {1e3 * (record.finished - record.started):.2f} ms" if record.finished is not None
                    else f"not finished, started {now - record.started:.1f} s ago")
            lines.append(f"  {record.describe()}: {took}")
        return "\n".join(lines)

    def _start_watchdog(self) -> None:
        if self._watchdog is not None:  # every collective asks: no lock once the thread runs
            return
        with self._lock:
            if self._watchdog is None:
                self._watchdog = threading.Thread(target=self._watch, name="fsdp_mpi watchdog", daemon=True)
                self._watchdog.start()

    def _watch(self) -> None:
        while True:
            pause = 0.1  # how long another rank's question may wait for its answer
            with self._lock:  # not while `stop_answering` closes it
                if self.liveness is not None:
                    try:
                        self.liveness.answer_questions()
                    except MPI.Exception:  # a rank was lost (ULFM): the survivors' communicator brings a new one
                        self.liveness = None
            for thread, (record, since, timeout, rank) in list(self.blocked.items()):
                if timeout <= 0:
                    continue
                asking = min(ASKING_SECONDS, timeout / 4)
                waited = time.monotonic() - since
                if waited >= timeout - asking:
                    answers = self._ask_the_others(asking)
                    if self.blocked.get(thread, (None,))[0] is record:  # still waiting in it
                        time.sleep(max(since + timeout - time.monotonic(), 0.0))
                        abort_job(self._timeout_message(record, time.monotonic() - since, timeout, rank, answers))
                pause = min(pause, max(timeout - asking - waited, 0.01))
            time.sleep(pause)

    def start_answering(self, liveness: Liveness) -> None:
        """Lets the watchdog answer other ranks' questions and ask its own, until the interpreter exits or another
        replaces it."""
        with self._lock:
            previous, self.liveness = self.liveness, liveness
        if previous is not None:  # the communicator of ranks before some were lost
            previous.close()
        else:
            atexit.register(self.stop_answering)  # runs before mpi4py's MPI_Finalize, registered earlier

    def stop_answering(self) -> None:
        with self._lock:
            liveness, self.liveness = self.liveness, None
        if liveness is not None:
            liveness.close()

    def _ask_the_others(self, seconds: float) -> str:
        if self.liveness is None:
            return ""
        return self.liveness.describe(self.liveness.silent_ranks(seconds), seconds) + "\n"

    def _timeout_message(self, record: CollectiveRecord, waited: float, timeout: float, rank: int,
                         answers: str) -> str:
        host = self.liveness.hosts[self.liveness.rank] if self.liveness else socket.gethostname()
        return (
            f"fsdp_mpi watchdog: rank {rank} (on {host}) has waited {waited:.1f} s in collective "
            f"{record.describe()}; its partners never arrived.\n{answers}"
            f"Another rank has left the training loop (uneven data: give every rank the same number of steps, "
            f"e.g. with fsdp_mpi.loop.even_batches), is stuck outside MPI, or is waiting in a different collective "
            f"(run with {VERIFY.name}=1 to find where ranks diverge).\n"
            f"Last collectives on rank {rank}, oldest first:\n{self.recent()}\n"
            f"The limit is {timeout:g} s: {TIMEOUT.name} or Communicator(timeout=...) sets it (0 turns it off).")


# One log per process: every communicator of this rank records into it, so that the
# watchdog's report shows the rank's whole recent history in order.
PROCESS_LOG = CollectiveLog()

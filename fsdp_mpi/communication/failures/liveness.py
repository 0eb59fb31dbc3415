"""Which ranks still answer: the watchdog's evidence when a collective never completes.

A rank stuck in a collective cannot tell a partner that died from a node whose
link went down or a partner that is merely somewhere else. So, shortly before
its timeout, the watchdog asks every other rank "are you there?", point to
point on a communicator of its own, and every rank's watchdog thread answers
such questions whatever its main thread is doing. The report then names the
ranks that did not answer and the hosts they run on: a failed node or link
shows as all the ranks of one host falling silent at once.

Asking needs two threads in MPI at once (``MPI_THREAD_MULTIPLE``, which both
pip MPIs provide); where the library does not allow it, the report names
hosts but asks nobody.
"""

import socket
import time

import numpy as np
from mpi4py import MPI

from fsdp_mpi.communication.failures.job import note_hosts

QUESTION, ANSWER = 1, 2
# How long closing waits for MPI to withdraw the receive for questions: on a communicator that lost a rank (ULFM)
# a cancelled receive from any rank may never complete, and a process must not hang on its way out.
CLOSE_SECONDS = 1.0


class Liveness:
    """Questions and answers between the ranks of `mpi_comm`. Building one is collective over it."""

    def __init__(self, mpi_comm):
        self.comm = mpi_comm.Dup()  # its own traffic never matches the training's
        self.rank = self.comm.Get_rank()
        self.hosts: list[str] = self.comm.allgather(socket.gethostname())
        note_hosts(mpi_comm, self.hosts)  # where a newcomer replacing one of them may start (job.py)
        self._asker = np.zeros(1, np.int64)
        self._question = self.comm.Irecv(self._asker, source=MPI.ANY_SOURCE, tag=QUESTION)
        self._sending: list[tuple[MPI.Request, np.ndarray]] = []  # kept alive until MPI has sent them

    def answer_questions(self) -> None:
        """Answers every question that has arrived (called from the watchdog thread, often)."""
        while self._question.Test():
            self._send(int(self._asker[0]), ANSWER)
            self._question = self.comm.Irecv(self._asker, source=MPI.ANY_SOURCE, tag=QUESTION)
        self._sending = [(request, data) for request, data in self._sending if not request.Test()]

    def close(self) -> None:
        """Withdraws the receive for questions: MPI must finish with no communication pending."""
        try:
            self._question.Cancel()
            deadline = time.monotonic() + CLOSE_SECONDS
            while not self._question.Test() and time.monotonic() < deadline:  # never a Wait: see CLOSE_SECONDS
                time.sleep(0.001)
        except MPI.Exception:  # its communicator lost a rank (ULFM): nothing is pending any more
            pass

    def _send(self, peer: int, tag: int) -> None:
        data = np.array([self.rank], np.int64)
        self._sending.append((self.comm.Isend(data, dest=peer, tag=tag), data))

    def silent_ranks(self, seconds: float) -> list[int]:
        """Asks every other rank and waits up to `seconds` for the answers: the ranks that gave none."""
        answers = {peer: np.zeros(1, np.int64) for peer in range(self.comm.Get_size()) if peer != self.rank}
        pending = {peer: self.comm.Irecv(buffer, source=peer, tag=ANSWER) for peer, buffer in answers.items()}
        for peer in answers:
            self._send(peer, QUESTION)
        deadline = time.monotonic() + seconds
        while pending and time.monotonic() < deadline:
            self.answer_questions()  # others may be asking at the same moment
            pending = {peer: request for peer, request in pending.items() if not request.Test()}
            time.sleep(0.01)
        return sorted(pending)  # their receives stay posted: the job is about to end

    def describe(self, silent: list[int], seconds: float) -> str:
        """One paragraph for the watchdog's report: who is silent, grouped by host."""
        if not silent:
            return (f"Every other rank answered within {seconds:g} s: they are alive and reachable, so they are in "
                    f"another collective or outside MPI.")
        by_host: dict[str, list[int]] = {}
        for peer in silent:
            by_host.setdefault(self.hosts[peer], []).append(peer)
        parts = []
        for host, ranks in by_host.items():
            whole = "all its ranks" if len(ranks) == self.hosts.count(host) else "some of its ranks"
            parts.append(f"{host} (rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {whole})")
        return (f"No answer within {seconds:g} s from {'; '.join(parts)}. A host whose ranks all fell silent has "
                f"failed or lost its network link; single silent ranks have ended (finished, or died) or are stuck where Python cannot run.")

"""The bookkeeping around every MPI call a ``Communicator`` makes: logged, checked across ranks, watched and timed.

Every call is recorded in the process's collective log and watched for hangs
(``collective_log``), and MPI's report of a lost rank becomes ``RankLostError``
(``lost_ranks``); in verify mode the ranks first check that they are all
entering the same collective (``verify_every_rank_enters``). The time a rank is
blocked in MPI, and the bytes each operation moves, add up in its ``Traffic``.

`comm` below is the ``Communicator`` making the call: these functions read its
rank, timeout, verify mode and traffic, and count its collectives, but make no
collective of their own beyond verify mode's check.
"""

import hashlib
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy
import torch
from mpi4py import MPI

from fsdp_mpi.communication.failures.collective_log import PROCESS_LOG, CollectiveRecord
from fsdp_mpi.communication.failures.lost_ranks import RankLostError, is_rank_lost
from fsdp_mpi.communication.settings import VERIFY


class CollectiveMismatchError(RuntimeError):
    """Verify mode: the ranks were about to enter different collectives."""


@dataclass(frozen=True)
class Collective:
    """One collective as its bookkeeping sees it."""

    operation: str  # its name in the collective log: "all_gather"
    sent: torch.Tensor  # this rank's contribution: what verify mode compares across ranks
    buffer: torch.Tensor  # the largest buffer: its memory chooses the transport, its bytes are counted
    unit: str = ""  # the sharded unit it serves, for the log and verify mode
    summed: bool = False  # MPI sums it: 16-bit values travel, and count, as fp32 copies


@dataclass
class Traffic:
    """What a rank's collectives cost it, for profiling: wall time blocked in MPI, and per operation the
    bytes of the full buffer each collective fills (all-gather) or reads (reduce-scatter, all-reduce) and
    of each broadcast tensor, in the dtype actually sent: what the wire carries, algorithms aside."""

    seconds_in_mpi: float = 0.0
    bytes_moved: Counter = field(default_factory=Counter)


def in_mpi(comm, operation: str, sent: torch.Tensor | None = None, unit: str = "", *, numel: int = 0,
           dtype: str = "", finishes: bool = True, collective: bool = True) -> "InMPI":
    """Every MPI call runs inside this, as ``with in_mpi(comm, ...) as record``.

    `sent` is the tensor this rank contributes (its size and dtype are logged); `unit` names the sharded unit
    the collective serves. A nonblocking call passes ``finishes=False``: its ``InFlight.wait()`` completes the
    record (``waiting_in_mpi``). The communicator has first made what it handed to its communication thread
    finish, so that its collectives enter MPI in program order. A message between two ranks passes
    ``collective=False``: logged and watched, but neither numbered among the collectives (the ranks it does not
    involve do not count it) nor checked in verify mode (``point_to_point.py`` checks each message itself).
    """
    if sent is not None:
        numel, dtype = sent.numel(), _dtype_name(sent.dtype)
    record = PROCESS_LOG.begin(comm.collectives_started, operation, unit, numel, dtype)
    comm.collectives_started += collective
    return InMPI(comm, record, finishes, verify=collective and comm.verify)


@contextmanager
def waiting_in_mpi(comm, record: CollectiveRecord):
    """Completing a nonblocking collective: watched and timed like a blocking one."""
    with PROCESS_LOG.blocking(record, comm.timeout, comm.rank):
        start = time.perf_counter()
        try:
            yield
        except MPI.Exception as error:
            _raise_if_rank_lost(error, comm, record)
            raise
        finally:
            comm.traffic.seconds_in_mpi += time.perf_counter() - start


class InMPI:
    """The bookkeeping around one MPI call (made by ``in_mpi``): the rank is marked as waiting in `record`
    (watched for hangs), verify mode checks the ranks agree, and the time is counted.
    A class rather than a generator-based context manager: every collective pays for it (0.6 µs less)."""

    __slots__ = ("comm", "record", "finishes", "verify", "start")

    def __init__(self, comm, record: CollectiveRecord, finishes: bool, verify: bool):
        self.comm, self.record, self.finishes, self.verify = comm, record, finishes, verify

    def __enter__(self) -> CollectiveRecord:
        comm = self.comm
        PROCESS_LOG.enter(self.record, comm.timeout, comm.rank)
        self.start = time.perf_counter()
        if self.verify:
            try:
                verify_every_rank_enters(comm, self.record)
            except BaseException:
                self.__exit__()
                raise
        return self.record

    def __exit__(self, exception_type=None, error=None, traceback=None) -> None:
        self.comm.traffic.seconds_in_mpi += time.perf_counter() - self.start
        PROCESS_LOG.leave(self.record, self.finishes)
        if error is not None:
            _raise_if_rank_lost(error, self.comm, self.record)


def _raise_if_rank_lost(error: BaseException, comm, record: CollectiveRecord) -> None:
    """Raises ``RankLostError`` in place of MPI's report that a rank of `comm` was lost."""
    if is_rank_lost(error, comm.mpi_comm):
        waited = time.monotonic() - record.started
        raise RankLostError(f"rank {comm.rank} of {comm.world_size} in {record.describe()}, after {waited:.3f} s "
                            f"in it: {error.Get_error_string()}", waited) from error


def verify_every_rank_enters(comm, record: CollectiveRecord) -> None:
    """Raises CollectiveMismatchError on every rank (rank 0 says which ranks entered what)
    unless all ranks are entering the same collective.

    Every rank calls this before every collective, so its own two calls always
    match each other in MPI whatever the ranks were about to do.
    """
    digest = int.from_bytes(hashlib.blake2b(record.fingerprint().encode(), digest_size=7).digest(), "little")
    extremes = numpy.array([digest, -digest], dtype=numpy.int64)  # max and -min of the digests over ranks
    comm.mpi_comm.Allreduce(MPI.IN_PLACE, [extremes, MPI.INT64_T], op=MPI.MAX)  # numpy: 10x less overhead
    if extremes[0] == -extremes[1]:
        return
    entering = comm.mpi_comm.allgather(record.describe())
    ranks_by_collective: dict[str, list[int]] = {}
    for rank, description in enumerate(entering):
        ranks_by_collective.setdefault(description, []).append(rank)
    lines = [f"  rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {description}"
             for description, ranks in ranks_by_collective.items()]
    if comm.rank != 0:  # every rank stops; one of them explains
        raise CollectiveMismatchError(f"ranks are entering different collectives ({VERIFY.name}): see rank 0")
    raise CollectiveMismatchError(
        f"ranks are entering different collectives ({VERIFY.name}):\n" + "\n".join(lines) + "\n"
        "Every rank must run the same units in the same order with the same shapes: look for control flow "
        "that depends on the rank or its data, a unit skipped on some ranks, or different model code.\n"
        f"Last collectives on rank {comm.rank}, oldest first:\n{PROCESS_LOG.recent()}")


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32, for the collective log (looked up: formatting it is slower than the lookup)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name

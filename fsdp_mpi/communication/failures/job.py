"""The job: the processes a run's ranks are numbered in, which a grow-back renews.

The job is ``MPI.COMM_WORLD`` as launched. Under ULFM a run may *grow back* after losing
ranks (ULFM's "respawn"): the survivors start one process per lost rank, running this same
program in a free slot of the allocation (``MPI_Comm_spawn``), merge with them, and order the
merged ranks so that each newcomer takes the number of the rank it replaces
(``Communicator.grow_back`` does the survivors' part). From then on that communicator is the
job, on survivors and newcomers alike: ranks are numbered in it (in messages, logs and
emulated nodes), and ``Communicator()`` means it.

A newcomer's program runs from the top, as the others' did. The first time it asks for the
job (``job_comm``, which ``Communicator()`` does) it finds that it was spawned and joins: it
merges with the survivors and takes its number. That is the survivors' ``grow_back``, seen
from the other side; nothing else in the program needs to know.
"""

import os
import sys

from mpi4py import MPI

_job = None  # the job's communicator, once asked for; on a newcomer, once it has joined
_replaced: list[int] = []  # the ranks of the job this process's grow-backs filled (a newcomer: its own)
_started: int | None = None  # the processes the job has started: its first ranks, and every newcomer since


def job_comm():
    """The job's communicator (an mpi4py one): ``MPI.COMM_WORLD``, or the one the last grow-back made. On a
    newcomer, the first call joins the survivors (collective with their ``grow_back``)."""
    global _job
    if _job is None:
        _job = _join() if is_newcomer() else MPI.COMM_WORLD
    return _job


def is_newcomer() -> bool:
    """Whether this process was started by a grow-back to take a lost rank's place (local)."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def job_rank() -> int:
    """This process's rank in the job: the number launchers, logs and messages give it."""
    return job_comm().Get_rank()


def job_ranks(mpi_comm) -> list[int]:
    """The ranks of `mpi_comm`, numbered as in the job (its dead ranks too: groups outlive processes)."""
    return mpi_comm.Get_group().Translate_ranks(list(range(mpi_comm.Get_size())), job_comm().Get_group())


def replaced_ranks() -> list[int]:
    """The ranks of the job that grow-backs filled with newcomers, as seen by this process."""
    return list(_replaced)


def free_slots() -> int | None:
    """The slots of the allocation that no process of the job has taken: ``MPI_UNIVERSE_SIZE`` (the slots the
    launcher was given) less the processes started, the dead ones included (Open MPI 5.0.11 gives a dead
    process's slot to nobody: with 3 slots, 3 ranks and one of them dead, a spawn is refused). None where the job
    already runs more processes than it has slots (its launcher oversubscribes, and so would a spawn) or MPI does
    not say."""
    universe = MPI.COMM_WORLD.Get_attr(MPI.UNIVERSE_SIZE)
    started = _started if _started is not None else MPI.COMM_WORLD.Get_size()
    return None if universe is None or started > universe else universe - started


def spawn_into(survivors, missing: list[int]):
    """The job renewed with a newcomer in each of `missing`'s places (ranks of the job), the survivors of
    `survivors` (an mpi4py communicator) keeping theirs; made the job. Collective over `survivors`. Raises
    ``MPI.Exception`` where no newcomer could be started (no free slot: the same on every survivor)."""
    info = MPI.Info.Create()
    info.Set("wdir", os.getcwd())  # the newcomers run this program where it runs, with its arguments
    try:
        newcomers = survivors.Spawn(sys.executable, args=sys.orig_argv[1:], maxprocs=len(missing), info=info)
    finally:
        info.Free()
    merged = newcomers.Merge(high=False)  # survivors first, in their order
    started = (_started if _started is not None else MPI.COMM_WORLD.Get_size()) + len(missing)
    merged.bcast((missing, started), root=0)
    return _become(merged.Split(0, job_rank()), missing, started)


def _join():
    """A newcomer's half of ``spawn_into``: the survivors' job, with this process in the place it was spawned
    to fill."""
    parent = MPI.Comm.Get_parent()
    parent.Set_errhandler(MPI.ERRORS_RETURN)  # a loss meanwhile is an error to handle, not the end of the job
    merged = parent.Merge(high=True)
    missing, started = merged.bcast(None, root=0)
    mine = missing[merged.Get_rank() - parent.Get_remote_size()]
    return _become(merged.Split(0, mine), [mine], started)


def _become(job, filled: list[int], started: int):
    global _job, _started
    job.Set_errhandler(MPI.ERRORS_RETURN)
    _job, _started = job, started
    _replaced.extend(filled)
    return job

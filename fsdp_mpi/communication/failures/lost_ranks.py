"""A rank that dies need not end the job: where MPI reports the loss (ULFM), the survivors are told and go on.

Without help from MPI a dead rank is only silence: its partners wait in their
next collective until the watchdog ends the job (``collective_log.py``). Open MPI
started with ``mpirun --with-ft ulfm`` instead returns an error from any call
that involved the dead rank (``MPI_ERR_PROC_FAILED``) and lets a rank *revoke*
a communicator, so that every call on it, anywhere, returns ``MPI_ERR_REVOKED``
at once. The ``Communicator`` turns both into ``RankLostError``; a rank that
catches it revokes every communicator it holds (so that no survivor stays
waiting on a live partner that has given up) and shrinks its world to the ranks
still alive (``Communicator.shrink``), on which training can go on.

Errors are not uniform: of two ranks in one collective, one may see the loss and
the other complete. ``Communicator.agree`` is the one uniform call (``MPI_Comm_agree``):
every survivor gets the same answer, so a training loop that agrees before its
optimizer step knows that every survivor steps, or none does.

Where the library cannot do this, ``continuation_unavailable`` says why, and the
job ends as before; nothing pretends (mpi4py quietly maps ``Shrink`` to a copy of
the communicator where the library has no ULFM).
"""

import functools
import os
import time

from mpi4py import MPI

from fsdp_mpi.communication.failures.job import job_comm

# The error classes by which ULFM reports a lost rank (mpi4py defines them only where the library has them).
LOST_RANK_ERRORS = frozenset(getattr(MPI, name) for name in ("ERR_PROC_FAILED", "ERR_PROC_FAILED_PENDING",
                                                            "ERR_REVOKED") if hasattr(MPI, name))
ULFM_LAUNCH = "mpirun --with-ft ulfm --mca btl tcp,self"
FAILURE_KNOWN_SECONDS = 1.0  # how long an unexplained MPI error waits for the failure detector's word


class RankLostError(RuntimeError):
    """A rank of this communicator has died, or a survivor has revoked it: the communicator (and every one
    split from it) can no longer be used. ``Communicator.shrink()`` gives the survivors one of their own.
    `waited`: the seconds this rank spent in the call that reported it (how long the loss took to reach it)."""

    def __init__(self, message: str, waited: float):
        super().__init__(message)
        self.waited = waited


def is_rank_lost(error: BaseException, mpi_comm) -> bool:
    """Whether `error`, raised by a call on `mpi_comm`, is MPI's report that a rank was lost (its failure, or a
    survivor's revocation). Open MPI 5.0.11 reports some losses as ``MPI_ERR_OTHER`` (a barrier on the rank next
    to the dead one, measured): in a job that can go on, an MPI error while the library knows of a failed rank
    *of `mpi_comm`* is a loss too. Asked of `mpi_comm`, not of the job: after a shrink the job's world keeps its
    dead ranks for good, and a real error on the survivors' communicator (a truncation) must reach the user."""
    if not isinstance(error, MPI.Exception):
        return False
    if error.Get_error_class() in LOST_RANK_ERRORS:
        return True
    if not can_go_on():
        return False
    deadline = time.monotonic() + FAILURE_KNOWN_SECONDS
    while mpi_comm.Get_failed().Get_size() == 0:  # the detector may hear of it a moment after the error
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def failed_ranks(mpi_comm) -> list[int]:
    """The ranks of `mpi_comm` that MPI knows to have failed, numbered as in the job (local)."""
    failed = mpi_comm.Get_failed()
    return failed.Translate_ranks(list(range(failed.Get_size())), job_comm().Get_group())


@functools.cache
def can_go_on() -> bool:
    """Whether this job can go on without a rank it loses (``continuation_unavailable``), asked once."""
    return continuation_unavailable() is None


def continuation_unavailable() -> str | None:
    """Why this job cannot go on without a rank it loses (None: it can). Local: reads the library and how the
    job was launched."""
    library = " ".join(MPI.Get_library_version().split(",")[0].split())  # "MPICH Version: 5.0.2", ...
    if "Open MPI" not in library:
        return (f"{library} cannot report a lost rank to the others (only Open MPI's ULFM can): a "
                f"lost rank ends the job, and hpc/resumable.sh starts it again")
    if not hasattr(MPI.Comm, "Shrink") or not LOST_RANK_ERRORS:
        return f"mpi4py {__import__('mpi4py').__version__} has no ULFM calls: install mpi4py 4 or later"
    if os.environ.get("OMPI_MCA_mpi_ft_enable", "").strip() not in ("1", "true"):
        how = ("it was started by srun, which cannot keep a job going: " if "PRTE_LAUNCHED" not in os.environ
               and "SLURM_STEP_ID" in os.environ else "")
        return f"{how}fault tolerance is off: start the job with `{ULFM_LAUNCH}` (inside the allocation)"
    transports = os.environ.get("OMPI_MCA_btl", "")
    if not transports or any(name in transports.split(",") for name in ("sm", "vader")):
        return (f"Open MPI's shared-memory transport cannot see a dead peer (it waits for it): start the job "
                f"with `{ULFM_LAUNCH}`")
    return None

"""One failing rank must end the whole job, not leave the others waiting in a collective.

MPI has no notion of a Python exception: a rank that dies from one simply
stops calling collectives, and every other rank blocks forever in its next one.
We print the traceback as Python would and then call ``MPI_Abort``, which tells
the launcher (mpiexec, srun) to kill every rank of the job. ``MPI_Abort`` skips
``atexit``: what must happen at any end (removing a file the CUDA driver leaves)
registers with ``before_abort`` too.
"""

import sys
import threading
import time

from mpi4py import MPI

from fsdp_mpi.communication.failures.job import is_newcomer, job_comm, replaced_ranks
from fsdp_mpi.communication.failures.lost_ranks import can_go_on, failed_ranks
from fsdp_mpi.communication.failures.process_end import exit_without_finalize

# MPI_Abort kills every rank at once and launchers drop output still in flight, so a
# rank waits this long after printing its traceback; ranks failing together all get heard.
SECONDS_TO_FLUSH_BEFORE_ABORT = 1.0

_installed = False
_before_abort: list = []


def before_abort(cleanup) -> None:
    """Runs `cleanup()` (quick, local, never raising) on this rank before it aborts the job."""
    _before_abort.append(cleanup)


def abort_job(message: str, mpi_comm=None) -> None:
    """Prints `message` on this rank's stderr, lets it reach the launcher, then ends every rank of the job."""
    comm = job_comm() if mpi_comm is None else mpi_comm
    sys.stderr.write(message.rstrip("\n") + "\n")
    sys.stderr.flush()
    for cleanup in _before_abort:
        cleanup()
    time.sleep(SECONDS_TO_FLUSH_BEFORE_ABORT)
    if _the_job_lost_a_rank():
        # Open MPI 5.0.11 under ULFM, once a rank of the job has died, an MPI_Abort is unreliable. mpirun may wait
        # long after every rank has ended (3 ranks, one killed, both survivors aborting: in two of four runs, one
        # still waiting after a minute, the other ending after about 3.5 minutes with status 0), and after the
        # job's rank 0 died it ends every rank but mpirun exits 0: a failed run reported as a success. A process
        # that ends with a non-zero status is a failed process to ULFM: the survivors waiting for it in a
        # collective are told, end the same way, and the job ends with that status (3 ranks, one killed: 6 of 6
        # runs ended with status 1 in under 8 s).
        exit_without_finalize(1)
    comm.Abort(1)


def _the_job_lost_a_rank() -> bool:
    """Whether MPI knows that a rank of the job has failed (only a job that can go on without a rank knows).
    False where it cannot be asked: the abort must not fail on the way."""
    try:
        return can_go_on() and (is_newcomer() or bool(replaced_ranks() or failed_ranks(MPI.COMM_WORLD)))
    except MPI.Exception:
        return False


def abort_job_on_uncaught_exception(mpi_comm=None) -> None:
    """Makes an uncaught exception on any thread of this rank abort the whole MPI job.

    Idempotent. Called by ``FullyShardedDataParallel`` when the job has more than
    one rank; scripts may call it earlier to cover their own set-up code.
    """
    global _installed
    if _installed:
        return
    _installed = True
    print_exception = sys.excepthook
    print_thread_exception = threading.excepthook

    def end_job(exc_type) -> None:
        comm = job_comm() if mpi_comm is None else mpi_comm  # asked then: a grow-back may have renewed the job
        abort_job(f"fsdp_mpi: rank {comm.Get_rank()} raised {exc_type.__name__}; aborting the MPI job", comm)

    def abort(exc_type, exc_value, exc_traceback):
        print_exception(exc_type, exc_value, exc_traceback)
        end_job(exc_type)

    def abort_from_thread(args):
        print_thread_exception(args)
        end_job(args.exc_type)

    sys.excepthook = abort
    threading.excepthook = abort_from_thread

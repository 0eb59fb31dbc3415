"""ULFM's step protocol at its edges, for tests/test_elastic.py, under ``mpirun --with-ft ulfm``.

    python lost_ranks.py          3 ranks: 2. and 3. below
    python lost_ranks.py early    1. below

1. The last rank dies before it ever exchanged a message: the others notice as they build their first
   communicator (a hand test once saw such a loss go unreported for 30 s), and the job ends at once with a
   message naming it: nothing has been trained to go on from.
2. Rank 2 dies after an exchange. Rank 0 meets the loss inside a collective; rank 1 meets none
   (its step was complete). Each ends the step in its one agreement (``end_step``), and both are told the step
   was abandoned: nobody shrinks while another survivor still waits in the agreement, and nobody takes the step.
3. On the survivors' communicator, a real MPI error (a message longer than its receive buffer) is raised as the
   error it is, not as a lost rank, although the job's world keeps counting its dead ranks.
4. Then the job's rank 0 dies too, and the last survivor raises an error of its own: the job must end with a
   non-zero status (under ULFM, Open MPI's mpirun exits 0 after an MPI_Abort once rank 0 is gone).

Prints "protocol holds" on each survivor when 2. and 3. hold.
"""

import os
import signal
import sys

import numpy
from mpi4py import MPI

from fsdp_mpi import Communicator, RankLostError, StepAbandoned, abort_job_on_uncaught_exception
from fsdp_mpi.communication.bookkeeping import in_mpi
from fsdp_mpi.elastic.agreement import end_step


def abandoned(comm: Communicator, interrupted: RankLostError | None) -> StepAbandoned:
    try:
        end_step(comm, interrupted)
    except StepAbandoned as step:
        return step
    raise AssertionError(f"rank {comm.rank}: the step was agreed complete although rank 2 was lost")


if sys.argv[1:] == ["early"]:
    if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    Communicator()
    raise AssertionError("a communicator was built with a rank that died")

abort_job_on_uncaught_exception()  # as a wrapped model makes it: an uncaught error ends the job (4.)
comm = Communicator()
comm.barrier()
if comm.rank == 2:
    os.kill(os.getpid(), signal.SIGKILL)
if comm.rank == 0:
    try:
        comm.all_reduce_sum_float(1.0)
        raise AssertionError("a collective with a dead rank completed")
    except RankLostError as lost:
        abandoned(comm, lost)
else:
    abandoned(comm, None)
survivors = comm.shrink()
assert survivors.world_size == 2, survivors.world_size
assert MPI.COMM_WORLD.Get_failed().Get_size() == 1  # what made every later error look like a loss before

if survivors.rank == 0:
    with in_mpi(survivors, "send 8 numbers", collective=False):
        survivors.mpi_comm.Send(numpy.zeros(8), dest=1)
else:
    try:
        with in_mpi(survivors, "receive 2 numbers", collective=False):
            survivors.mpi_comm.Recv(numpy.zeros(2), source=0)
        raise AssertionError("a message longer than its receive buffer was received")
    except RankLostError as error:
        raise AssertionError(f"a truncated message was taken for a lost rank: {error}") from None
    except MPI.Exception as error:
        assert error.Get_error_class() == MPI.ERR_TRUNCATE, error.Get_error_string()
survivors.barrier()
print(f"rank {MPI.COMM_WORLD.Get_rank()}: protocol holds", flush=True)

if survivors.rank == 0:  # the job's rank 0
    os.kill(os.getpid(), signal.SIGKILL)
try:
    survivors.barrier()
except RankLostError:
    pass
raise RuntimeError("a survivor's own error after the job's rank 0 was lost")

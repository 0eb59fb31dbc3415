"""The one agreement that ends every optimizer step, whatever happened in it (ULFM's pattern).

A lost rank reaches the survivors unevenly: one sees ``RankLostError`` in a forward's
all-gather while another finishes its backward, and a third waits in a reduce-scatter
for a partner that has given up. ULFM's answer is that every survivor ends the step in
exactly one agreement (``MPI_Comm_agree``), saying whether its step was complete:

- a rank whose step was interrupted first *revokes* the communicator, so that no survivor
  stays waiting in a collective for it, then agrees with "not complete";
- a rank whose step completed agrees with "complete";
- the answer, the same on every survivor, is "complete" only if every rank's step was and no
  rank was lost (an agreement that meets a lost rank raises on every survivor alike).

Only after that answer does anybody update weights (all of them, or none) or shrink. Between
two agreements everything a rank does is one *step*: a rank lost anywhere in it, in a
checkpoint save or a validation as much as in a backward, ends it the same way.

The same agreement carries a second answer at no extra cost: whether to grow back now. A run
that has lost ranks and has a hosts file (``failures/job.py``) has its rank 0 read the file at
each step boundary; where hosts were added, the step is abandoned as for a loss (``GrowthAgreed``),
and the ranks grow back to the job's size before taking it again.
"""

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.failures.job import hosts_were_added, ranks_missing
from fsdp_mpi.communication.failures.lost_ranks import RankLostError, can_go_on

# The bits each rank agrees on (and-ed over the ranks): its step was complete; it sees no reason to grow back.
COMPLETE, STAY = 1, 2


class StepAbandoned(RankLostError):
    """The ranks agreed that this step was not complete on all of them (a rank was lost): nobody takes it. Raised
    after this rank's one agreement of the step: whoever catches it goes on to recover without agreeing again."""

    def __init__(self, message: str, waited: float = 0.0):
        super().__init__(message, waited)


class GrowthAgreed(StepAbandoned):
    """Nobody was lost, but hosts were added while ranks are missing: the ranks agreed to grow back before this
    step's update. The step is abandoned as for a loss (and taken again on the grown job); nothing shrinks."""


def end_step(comm: Communicator, interrupted: RankLostError | None = None) -> None:
    """This rank's one agreement for the step (collective over the survivors of `comm`): returns if every rank's
    step was complete, else raises ``StepAbandoned`` (on every survivor alike); ``GrowthAgreed`` where it was,
    but rank 0 found hosts added to grow back into. `interrupted`: the loss that cut this rank's step short (its
    communicators are revoked first, so that no survivor waits for this rank). Where the job cannot go on without
    a lost rank (MPICH, Intel MPI, Open MPI without ULFM), a loss ends it anyway: there is nothing to agree on,
    and nothing is called."""
    if interrupted is None and not can_go_on():
        return
    if interrupted is not None:
        comm.revoke()
    grow = interrupted is None and comm.rank == 0 and ranks_missing(comm.mpi_comm) and hosts_were_added()
    try:
        agreed = comm.agree((COMPLETE if interrupted is None else 0) | (0 if grow else STAY))
    except RankLostError as lost:  # the agreement itself met the lost rank: on every survivor alike
        raise StepAbandoned(f"a rank was lost during the step ({lost})", lost.waited) from None
    if not agreed & COMPLETE:
        raise StepAbandoned(f"a rank was lost during the step ({interrupted})" if interrupted else
                            "another rank's step was interrupted by a lost rank",
                            interrupted.waited if interrupted else 0.0)
    if not agreed & STAY:
        raise GrowthAgreed("hosts were added to the job's hosts file: the ranks grow back before this step")

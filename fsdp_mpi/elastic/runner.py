"""``fsdp_mpi.run_elastic``: a user's training function that goes on after a lost rank, in a few lines.

    def build(comm):                          # every rank; again on the survivors after a loss
        model = FSDP(Net(), comm=comm, auto_wrap_policy=...)
        optimizer = torch.optim.AdamW(model.parameters())
        return ElasticState(model, optimizer)

    def train(state):                         # called again after a loss, at the last commit
        while state.step < steps:
            loss = loss_of(state.model, samples(state.step, state.started_on))
            loss.backward()
            state.commit()                    # the step's agreement, then the update

    run_elastic(train, build)

As Horovod Elastic's ``hvd.elastic.run`` does, the runner calls the training function and,
when a rank is lost anywhere in it, runs the recovery and calls it again with the state
rebuilt on the survivors. What the loop owes it: every step ends in ``commit()`` (nothing
else changes the weights), and where it is in the data follows from ``state.step`` and
``state.counters`` (a global batch fixed by ``state.started_on``, each rank's part of it cut
anew on the ranks of the moment), so that the call after a loss continues where the last
commit was.

Under it, ULFM's protocol (``agreement.py``): a rank whose step was cut short revokes the
communicators and agrees "not complete"; every other survivor meets it in the same
agreement, inside ``commit()``; then all of them recover together (``recovery.py``). The
run ends with one more agreement, so that no rank leaves while another is recovering.

With ``grow_back=True`` the survivors start a newcomer in each lost rank's place where the
allocation has a free slot. The newcomer runs the same program from the top: its
``run_elastic`` finds that it was started to fill a place (``failures/job.py``), joins the
survivors' recovery (``recovery.join``) and calls ``train`` with the state it was given.
Where no slot is free at the loss, the run goes on shrunk; with a ``hosts_file`` it grows back
at the first step boundary after hosts are added to it (``agreement.GrowthAgreed``).
"""

import sys
from pathlib import Path
from typing import Callable, TypeVar

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.failures.job import add_hosts_from, is_newcomer, job_rank, job_ranks
from fsdp_mpi.communication.failures.lost_ranks import RankLostError, continuation_unavailable
from fsdp_mpi.elastic.agreement import GrowthAgreed, StepAbandoned, end_step
from fsdp_mpi.elastic.recovery import (CannotGoOn, Left, Plan, Recovered, abandon_the_step, collect_the_old_run,
                                      end_for_lack_of_state, forget_the_interrupted_step, join, newcomer_message,
                                      recover, shrink_until_it_holds)
from fsdp_mpi.elastic.state import ElasticState
from fsdp_mpi.files.checkpoint_directory import CheckpointDirectory

Result = TypeVar("Result")
Run = TypeVar("Run")


class Elastic:
    """What a run that survives lost ranks has been through: how many recoveries, and whether this rank left."""

    def __init__(self):
        self.recoveries: list[str] = []  # each recovery's message, as printed
        self.left: Left | None = None  # set on a rank whose shard group broke while others went on
        self.lost_ranks: list[int] = []  # every rank lost, numbered as in the job
        self.newcomer = False  # whether this process was started in a lost rank's place (``grow_back``)


def run_elastic(train: Callable[[ElasticState], Result], build: Callable[[Communicator], ElasticState],
                comm: Communicator | None = None, *, checkpoint_dir: str | Path | None = None,
                checkpoint_every: int = 0, elastic: Elastic | None = None, grow_back: bool = False,
                hosts_file: str | Path | None = None) -> Result | None:
    """Calls ``train(build(comm))`` and, after each lost rank, ``train`` again on the survivors' rebuilt state.

    Args:
        train: the training function; it ends every optimizer step with ``state.commit()``.
        build: the state built on a communicator's ranks, as at the start (called again after each loss).
        comm: the ranks to train on (all of them by default).
        checkpoint_dir: where the state is saved every `checkpoint_every` steps, and at the start; after a
            loss under FULL_SHARD or SHARD_GRAD_OP (whose lost shards exist nowhere else) the survivors load the
            latest one. A directory that already holds checkpoints is resumed from.
        elastic: filled with what the run went through (recoveries, lost ranks, whether this rank left).
        grow_back: after a loss, start a newcomer running this program in each lost rank's place, where the
            allocation has a free slot (``mpirun`` given more slots than ranks), and go on with as many ranks as
            before: under HYBRID_SHARD and NO_SHARD each newcomer gets its state from its twin (the survivor
            holding the same shards), otherwise every rank loads the latest checkpoint. Where no slot is free,
            says so and goes on with the survivors.
        hosts_file: with `grow_back`, a file of ``HOST:SLOTS`` lines the run reads at every step boundary while
            it is short of ranks: hosts added to it are added to the allocation, and the run grows back into them
            before the next update (the file's hosts are also handed to every spawn).

    Returns `train`'s result; None on a rank that left (its shard group broke while others went on from memory).
    Where MPI cannot report a lost rank (``continuation_unavailable``), says so once and trains as usual: a
    lost rank then ends the job. After a loss, a run that cannot go on (nothing holds the lost state) says why
    and ends every survivor with exit code 2; the process of a survivor should end with
    ``exit_without_finalize`` (MPI's finalize may wait forever after a loss).
    """
    if checkpoint_dir is not None and checkpoint_every < 1:
        raise ValueError("checkpoint_every must be at least 1 with a checkpoint_dir: the survivors of a lost rank "
                         "under FULL_SHARD reload the latest checkpoint")
    comm, elastic, unavailable = set_up(comm, grow_back, hosts_file, elastic, "fsdp_mpi.elastic")
    directory = (lambda on: CheckpointDirectory(checkpoint_dir, on)) if checkpoint_dir is not None else None
    plan = Plan(build=lambda on: _checkpointed(build(on), directory, checkpoint_every),
                shard_comm=lambda run: run.model.groups.shard, replica_comm=lambda run: run.model.groups.replicas,
                held=ElasticState.held, take=ElasticState.take,
                from_checkpoint=(lambda run: run.load(directory(run.comm))) if directory else None,
                position=lambda run: run.step, release=lambda run: run.optimizer.state.clear(),
                save=(lambda run: run.save(directory(run.comm))) if directory else None, grow_back=grow_back)

    def start() -> ElasticState:
        if is_newcomer():  # started by the survivors' recovery, in a lost rank's place
            elastic.newcomer = True
            state = recovered(join(comm, plan), 0.0, elastic, plan)
            print(f"fsdp_mpi.elastic: {newcomer_message(state.comm.rank, state.step)}", flush=True)
            return state
        return _first_state(lambda on: _started(build(on), directory, checkpoint_every), comm, unavailable, elastic)

    return go_on_through_losses(start, train, plan, elastic, unavailable, roll_back=ElasticState.roll_back)


def set_up(comm: Communicator | None, grow_back: bool, hosts_file: str | Path | None, elastic: Elastic | None,
           speaker: str) -> tuple[Communicator, Elastic, str | None]:
    """What ``run_elastic`` and ``fit_elastic`` start from: the ranks (all by default), the hosts file noted, what
    the run goes through, and why MPI cannot report a lost rank (None where it can), said once as `speaker`."""
    if hosts_file is not None and not grow_back:
        raise ValueError("hosts_file is read to grow back into the hosts added: it needs grow_back=True")
    comm = comm if comm is not None else Communicator()
    if hosts_file is not None:
        add_hosts_from(hosts_file)
    unavailable = continuation_unavailable()
    if unavailable and comm.rank == 0:
        print(f"{speaker}: a lost rank will end the job: {unavailable}", file=sys.stderr, flush=True)
    return comm, elastic if elastic is not None else Elastic(), unavailable


def go_on_through_losses(start: Callable[[], Run], train: Callable[[Run], Result], plan: Plan[Run],
                         elastic: Elastic, unavailable: str | None,
                         roll_back: Callable[[Run], None] = lambda run: None) -> Result | None:
    """`train(start())` and, after each loss anywhere in it (or hosts added to grow back into), `train` again on
    the run that the recovery rebuilt: the one loop of ``run_elastic`` and of Lightning's ``fit_elastic``. A run
    trains on ``run.comm``; `roll_back` puts it back at its last commit once its step is abandoned. The first run
    is made here, so that no caller's frame keeps it alive after a recovery has replaced it. Returns `train`'s
    result; None on a rank that left."""
    run = start()
    while True:
        try:
            result = train(run)
            end_step(run.comm)  # the run's last agreement: nobody leaves while others recover
            return result
        except RankLostError as error:
            if unavailable:
                raise
            lost = error
        abandon_the_step(run.comm, lost)
        roll_back(run)
        try:
            outcome = recover(run, run.comm, plan, growing=isinstance(lost, GrowthAgreed))
        except CannotGoOn as failure:
            end_for_lack_of_state(failure, f"fsdp_mpi.elastic: the run cannot go on: {failure}")
        if isinstance(outcome, Left):
            elastic.left, elastic.lost_ranks = outcome, sorted(set(elastic.lost_ranks) | set(outcome.lost))
            print(f"fsdp_mpi.elastic: rank {job_rank()}: {outcome.message(plan.position(run))}", flush=True)
            return None
        run = recovered(outcome, lost.waited, elastic, plan)
        del outcome
        collect_the_old_run()


def recovered(outcome: Recovered[Run], noticed_after: float, elastic: Elastic, plan: Plan[Run]) -> Run:
    """The run a recovery (or a newcomer's join) rebuilt, what happened kept in `elastic` and said once."""
    message = outcome.message(plan.position(outcome.run), noticed_after)
    elastic.recoveries.append(message)
    elastic.lost_ranks = sorted(set(elastic.lost_ranks) | set(outcome.lost))
    if outcome.speaker:
        print(f"fsdp_mpi.elastic: {message}", flush=True)
    return outcome.run


def _first_state(start: Callable[[Communicator], ElasticState], comm: Communicator, unavailable: str | None,
                 elastic: Elastic) -> ElasticState:
    """`start(comm)`, ended like a step in one agreement: a rank lost while the state is first built makes the
    survivors build it again among themselves (nothing is trained yet, nothing moves)."""
    while True:
        try:
            state, lost = start(comm), None
        except RankLostError as error:
            if unavailable:
                raise
            state, lost = None, error
            forget_the_interrupted_step(lost)
        try:
            end_step(comm, lost)
            return state
        except StepAbandoned:
            survivors, alive = shrink_until_it_holds(comm)
            gone = sorted(set(job_ranks(comm.mpi_comm)) - set(alive))
            elastic.lost_ranks = sorted(set(elastic.lost_ranks) | set(gone))
            if survivors.rank == 0:
                print(f"fsdp_mpi.elastic: lost rank(s) {', '.join(map(str, gone))} of the job as the run was first "
                      f"built; {survivors.world_size} rank(s) build it again", flush=True)
            comm = survivors


def _started(state: ElasticState, directory, every: int) -> ElasticState:
    """`state` at the start: resumed from the directory's latest checkpoint, or saved there as step 0 (so that a
    loss before the first periodic save has something to reload)."""
    state = _checkpointed(state, directory, every)
    if directory is not None and not state.load(directory(state.comm)):
        state.save(directory(state.comm))
    return state


def _checkpointed(state: ElasticState, directory, every: int) -> ElasticState:
    if directory is not None:
        state.keep_checkpoints(directory(state.comm), every)
    return state

"""--keep-going: a run that loses ranks goes on with the survivors, in the same job, at the same sample.

The protocol is the library's (``fsdp_mpi.elastic``): every survivor ends each optimizer step in
one agreement (``end_step``, in ``loop.optimizer_step``), the weights change only after it, and
after a step abandoned for a lost rank the survivors shrink, decide between memory and the
latest checkpoint, and rebuild, all inside one retry (``fsdp_mpi.elastic.recovery``). What this
module adds is the experiments' part of it: how their run (model, optimizer, schedule, CSV
recorder, position in the data) is rebuilt on a communicator, and how its state moves.

With --grow-back a newcomer takes each lost rank's place (``fsdp_mpi.run_elastic``'s
``grow_back``): its program runs from the top, skips the start-up's collectives (the others
are in their recovery) and joins the recovery here (``join_the_run``), the run's state coming
from its twin's memory or the latest checkpoint. With --add-hosts a run that went on shrunk
grows back at the step boundary after hosts are written into that file.

The global batch stays that of the ranks the run started on (each step takes as many
micro-batches as its samples need), and dropout follows the sample, so the steps after the loss
compute what a run without it computes.
"""

from dataclasses import dataclass

from training.resume import Position, RunCheckpoints

from fsdp_mpi import Communicator, RankLostError
from fsdp_mpi.elastic import recovery
from fsdp_mpi.elastic.agreement import GrowthAgreed

_going_on: Communicator | None = None  # after a loss: the ranks this process trains with now (set below)


def survivors() -> Communicator | None:
    """The communicator of the ranks this process went on with after losing a rank, or None if it lost none:
    its rank 0 speaks for the run, and the process ends without ``MPI_Finalize``."""
    return _going_on


@dataclass
class Left:
    """This rank's shard group lost a rank while another went on: it leaves the run."""

    left: recovery.Left
    step: int

    exit_code = 0

    def message(self) -> str:
        return self.left.message(self.step)


def go_on_without_the_lost(run, position: Position, lost: RankLostError, start_run):
    """After `lost`: the run rebuilt on the ranks that go on, and where it is (``(run, position)``), or ``Left``.
    Collective over the survivors (and, with --grow-back, the newcomers' ``join_the_run``). `start_run` builds a
    run on a communicator (``loop.start_run``). Ends the process (exit code 2) where nothing holds the lost state."""
    global _going_on
    recovery.abandon_the_step(run.comm, lost)
    run.optimizer.zero_grad(set_to_none=True)  # the abandoned step's gradients
    run.prepared.scaler.abandon_step()
    _going_on = run.comm  # until the recovery names the survivors: an error meanwhile ends without finalize
    resumed_at: list[Position] = []
    plan = _plan(lambda comm: start_run(run.task, run.config, comm, run.device, run.experiment, run.batching),
                 run.config, position, resumed_at)
    try:
        outcome = recovery.recover(run, run.comm, plan, growing=isinstance(lost, GrowthAgreed))
    except recovery.CannotGoOn as failure:
        recovery.end_for_lack_of_state(failure, f"--keep-going: {failure}: the run ends here")
    if isinstance(outcome, recovery.Left):
        return Left(outcome, position.step)
    _going_on = outcome.run.comm
    if outcome.speaker:
        cause = "" if isinstance(lost, GrowthAgreed) else f" ({lost})"
        print(f"--keep-going: {outcome.message(resumed_at[-1].step if resumed_at else position.step, lost.waited)}"
              f"{cause}", flush=True)
    return outcome.run, resumed_at[-1] if resumed_at else position


def join_the_run(build, config, comm: Communicator):
    """A newcomer's start (--grow-back): the run built on the job it joined in a lost rank's place, with its
    state from its twin or the latest checkpoint, and where it is (``(run, position)``). Collective with the
    survivors' ``go_on_without_the_lost``. `build` builds a run on a communicator."""
    global _going_on
    _going_on = comm  # a newcomer, too, ends without MPI_Finalize
    resumed_at: list[Position] = []
    outcome = recovery.join(comm, _plan(build, config, None, resumed_at))
    print(f"--keep-going: {recovery.newcomer_message(comm.rank, resumed_at[-1].step)}", flush=True)
    return outcome.run, resumed_at[-1]


def _plan(build, config, position: Position | None, resumed_at: list[Position]) -> recovery.Plan:
    """How the experiments' run is rebuilt on a communicator and its state moved, for ``recovery``: where the run
    stands after it is appended to `resumed_at` (`position`, None on a newcomer: its twin's, or the checkpoint's)."""

    def built(comm: Communicator):
        global _going_on
        _going_on = comm  # an error from here on (a damaged checkpoint) is said by this communicator's rank 0
        return build(comm)

    def from_checkpoint(rebuilt) -> bool:
        checkpoints = RunCheckpoints(rebuilt)
        if checkpoints.directory.latest() is None:
            return False
        resumed_at.append(checkpoints.restore())
        return True

    def take(rebuilt, held: dict) -> None:
        _take(rebuilt, held)
        resumed_at.append(held["position"])

    return recovery.Plan(
        build=built,
        shard_comm=lambda old: old.prepared.model.groups.shard,
        replica_comm=lambda old: old.prepared.model.groups.replicas,
        held=lambda old: {**_held(old), "position": position}, take=take,
        from_checkpoint=from_checkpoint if config.checkpoint_dir else None,
        position=lambda _: (position.step, position.epoch, position.tally.steps),
        release=lambda old: old.optimizer.state.clear(),
        save=(lambda old: RunCheckpoints(old).save(position)) if config.checkpoint_dir else None,
        grow_back=config.grow_back)


def _held(run) -> dict:
    """`run`'s shards, optimizer state, schedule, loss scale and CSV rows, as ``_take`` puts them into another."""
    return {"shards": recovery.shards_of(run.prepared.model), "optimizer": run.optimizer.state_dict(),
            "schedule": run.schedule.state_dict(), "scaler": run.prepared.scaler.state_dict(),
            "recorder": (run.recorder.run_id, run.recorder.rows, run.recorder.step_rows)}


def _take(run, held: dict) -> None:
    """Puts `held` into `run`, whose shard groups are laid out as those of the run it was held by (the same size,
    each rank in its place): every parameter's shard has the same elements."""
    recovery.put_shards(run.prepared.model, held["shards"])
    run.optimizer.load_state_dict(held["optimizer"])
    run.schedule.load_state_dict(held["schedule"])
    run.prepared.scaler.load_state_dict(held["scaler"])
    run.recorder.resume(*held["recorder"])

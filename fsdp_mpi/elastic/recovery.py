"""After a step abandoned for a lost rank: the survivors shrink, decide where the state comes from, and rebuild.

Every survivor arrives here from the same agreement (``agreement.end_step``), so every one
of them recovers, and from the same committed state. Then, collectively:

1. the world shrinks to the ranks still alive (``Communicator.shrink``);
2. the survivors decide where the state comes from:
   - a shard group all of whose ranks are alive still holds a whole replica (HYBRID_SHARD,
     NO_SHARD): those groups go on from memory, and the ranks of broken groups leave;
   - otherwise (FULL_SHARD, SHARD_GRAD_OP, or no replica left whole) every survivor loads the
     latest checkpoint, resharded onto their number; with none to load, the run cannot go on;
3. the ranks that go on build the run on their communicator, as a run started there would be
   built, and put the state in.

A rank lost during any of this (a node's ranks noticed one after the other, a second failure)
makes the survivors shrink again and start over from the same committed state: every
collective of the recovery is inside that retry. MPI makes a communicator's creation
(split, shrink) succeed on every rank or fail on every rank, so all survivors always retry
from the same communicator.
"""

import gc
import sys
import time
from dataclasses import dataclass
from typing import Callable, Generic, NoReturn, TypeVar

import torch
from mpi4py import MPI
from torch import nn

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.failures.abort import exit_without_finalize
from fsdp_mpi.communication.failures.lost_ranks import RankLostError
from fsdp_mpi.elastic.agreement import StepAbandoned, end_step
from fsdp_mpi.sharding.host_memory import give_back_freed_host_memory

Run = TypeVar("Run")  # whatever the loop keeps its state in: an ElasticState, the experiments' Run


class CannotGoOn(RuntimeError):
    """No shard group is left whole and there is no checkpoint to reload: the state of the lost ranks is gone.
    Raised on every survivor alike; `speaker`: whether this rank is the one that says so (rank 0 of them)."""

    def __init__(self, message: str, speaker: bool):
        super().__init__(message)
        self.speaker = speaker


@dataclass
class Left:
    """This rank's shard group lost a rank while other groups, left whole, go on from memory: it leaves."""

    lost: list[int]  # the ranks lost, numbered as in the job

    def message(self, step: int) -> str:
        return (f"left the run at optimizer step {step}: its shard group lost rank(s) "
                f"{', '.join(map(str, self.lost))}, and the groups left whole go on")


@dataclass
class Recovered(Generic[Run]):
    """The run rebuilt on the ranks that go on, and what the recovery saw and took."""

    run: Run
    lost: list[int]  # the ranks lost, numbered as in the job
    before: int  # ranks training before the loss
    after: int  # ranks training now
    from_memory: bool
    shrink_seconds: float
    rebuild_seconds: float

    def message(self, step: int, noticed_after: float) -> str:
        source = "memory (the shard groups left whole)" if self.from_memory else "the latest checkpoint"
        return (f"lost rank(s) {', '.join(map(str, self.lost))} of the job ({self.before} training before); "
                f"{self.after} rank(s) go on from {source} at optimizer step {step}. "
                f"Noticed after {noticed_after:.3f} s in a collective, shrunk in {self.shrink_seconds:.3f} s, "
                f"rebuilt in {self.rebuild_seconds:.3f} s")


@dataclass
class Plan(Generic[Run]):
    """What the loop supplies to rebuild its run on the survivors.

    build: the run built and wrapped on a communicator's ranks, exactly as a run started there is built.
    shard_comm: a run's shard group (``model.groups.shard``): whether it is whole decides the source.
    replicated: whether other shard groups hold replicas of a run's shards (HYBRID_SHARD, NO_SHARD).
    from_memory: puts the old run's committed state into the new one (shard groups laid out alike).
    from_checkpoint: loads the latest checkpoint into the new run; False if there is none. None: the run keeps
        no checkpoints.
    release: frees what of the old run's state a reload replaces (its optimizer state), before the new run is
        built beside it: the recovery then holds one copy of the state more than a run started on the survivors
        would, not two.
    position: where a run is (its committed step, and anything else that says where it is in the data), checked
        to be the same on every rank that goes on from memory.
    """

    build: Callable[[Communicator], Run]
    shard_comm: Callable[[Run], Communicator]
    replicated: Callable[[Run], bool]
    from_memory: Callable[[Run, Run], None]
    from_checkpoint: Callable[[Run], bool] | None
    position: Callable[[Run], object]
    release: Callable[[Run], None]


def recover(run: Run, comm: Communicator, plan: Plan[Run]) -> Recovered[Run] | Left:
    """`run`, trained on `comm`, rebuilt on the ranks that go on after a loss (collective over the survivors of
    `comm`, every one of which has abandoned the step). Raises ``CannotGoOn`` where the lost state is nowhere."""
    started, before = time.perf_counter(), comm.world_size
    lost: set[int] = set()
    failing = comm  # the communicator a loss was last seen on: the next shrink's
    while True:
        survivors, alive = shrink_until_it_holds(failing)
        lost |= set(job_ranks(failing.mpi_comm)) - set(alive)
        shrunk = time.perf_counter()
        failing = survivors
        try:
            whole = survivors.all_gather_object(set(job_ranks(plan.shard_comm(run).mpi_comm)) <= set(alive))
            from_memory = plan.replicated(run) and any(whole)
            if from_memory and not whole[survivors.rank]:
                survivors.split(MPI.UNDEFINED)
                return Left(sorted(lost))
            if not from_memory and plan.from_checkpoint is None:
                raise CannotGoOn(f"lost rank(s) {', '.join(map(str, sorted(lost)))}, and no shard group is left "
                                 "whole to go on from memory nor a checkpoint directory to reload",
                                 survivors.rank == 0)
            going_on = survivors.split(0) if from_memory else survivors
            failing = going_on
            rebuilt = _rebuild(run, going_on, from_memory, plan)
            going_on.watch_liveness()
            return Recovered(rebuilt, sorted(lost), before, going_on.world_size, from_memory, shrunk - started,
                             time.perf_counter() - shrunk)
        except RankLostError:
            continue  # shrink `failing` again, from the same committed state


def _rebuild(run: Run, going_on: Communicator, from_memory: bool, plan: Plan[Run]) -> Run:
    """`run`'s committed state in a run built on `going_on`'s ranks, from memory or the latest checkpoint."""
    if not from_memory:  # nothing of the old state is read again: a second loss only ever leaves fewer groups whole
        plan.release(run)
    gc.collect()  # the interrupted step's frames (its activations) and an earlier run's cycles, before the build
    give_back_freed_host_memory()
    rebuilt = plan.build(going_on)
    if from_memory:
        positions = going_on.all_gather_object(plan.position(run))
        if any(where != positions[0] for where in positions):  # the agreement before every update rules it out
            raise RuntimeError(f"the ranks going on from memory stand at different places {positions}: their "
                               "states differ, so none of them can be trusted")
        plan.from_memory(run, rebuilt)
    elif not plan.from_checkpoint(rebuilt):
        raise CannotGoOn("no checkpoint has been saved yet to reload the lost shards from", going_on.rank == 0)
    return rebuilt


def collect_the_old_run() -> None:
    """Frees the run a recovery replaced, once the loop holds only the new one: the old run lives on in its
    reference cycles (model, hooks, communicator, node memory) until Python's next full collection, one more
    copy of the state through the steps after the loss."""
    gc.collect()


def move_shards(old: nn.Module, new: nn.Module) -> None:
    """Copies every parameter's shard of the wrapped model `old` into `new`, built on the ranks that go on with
    shard groups laid out as `old`'s (the same size, each rank in its place: each shard has the same elements)."""
    new_parameters = dict(new.named_parameters())
    with torch.no_grad():
        for name, parameter in old.named_parameters():
            if new_parameters[name].shape != parameter.shape:
                raise RuntimeError(f"{name}'s shard has {tuple(parameter.shape)} elements here but "
                                   f"{tuple(new_parameters[name].shape)} on the ranks left: the shard groups "
                                   "changed, so the state cannot move from memory")
            new_parameters[name].copy_(parameter)


def abandon_the_step(comm: Communicator, lost: RankLostError) -> None:
    """This rank's part of a step that `lost` cut short, before ``recover``: the step's frames dropped, and its
    one agreement made, saying "not complete" (unless `lost` is that agreement's own answer)."""
    forget_the_interrupted_step(lost)
    if not isinstance(lost, StepAbandoned):
        try:
            end_step(comm, lost)
        except StepAbandoned:
            pass


def end_for_lack_of_state(failure: CannotGoOn, message: str) -> NoReturn:
    """Ends every survivor with exit code 2 where nothing holds the lost state, `message` said once (by the
    survivors' rank 0)."""
    if failure.speaker:
        print(message, file=sys.stderr, flush=True)
    exit_without_finalize(2)


def forget_the_interrupted_step(error: BaseException) -> None:
    """Drops the frames that `error` (and the errors it was raised from) hold: the interrupted step's activations
    and gathered weights, as much memory as the step's peak, not kept while the run is built again."""
    while error is not None:
        error.__traceback__ = None
        error = error.__cause__ or error.__context__


def shrink_until_it_holds(comm: Communicator) -> tuple[Communicator, list[int]]:
    """`comm`'s survivors and their ranks in the job, shrunk again if a rank is lost meanwhile."""
    while True:
        survivors = comm.shrink()
        try:
            return survivors, survivors.all_gather_object(MPI.COMM_WORLD.Get_rank())
        except RankLostError:
            comm = survivors


def job_ranks(mpi_comm) -> list[int]:
    """The ranks of `mpi_comm`, numbered as in the job (``MPI.COMM_WORLD``), as launchers and logs number them."""
    return mpi_comm.Get_group().Translate_ranks(list(range(mpi_comm.Get_size())), MPI.COMM_WORLD.Get_group())

"""After a step abandoned for a lost rank: the survivors shrink, decide where the state comes from, and rebuild.

Every survivor arrives here from the same agreement (``agreement.end_step``), so every one
of them recovers, and from the same committed state. Then, collectively:

1. the world shrinks to the ranks still alive (``Communicator.shrink``);
2. where the run grows back (``Plan.grow_back``) and the allocation has free slots, the
   survivors start a newcomer in each lost rank's place (``Communicator.grow_back``), and the
   run goes on with as many ranks as before, each in its place:
   - where every lost rank's shards live on in a replica (HYBRID_SHARD, NO_SHARD: its *twin*,
     the survivor at the same place in another shard group), every survivor keeps its own
     state and each twin sends a copy of its state to its newcomer (the heal);
   - otherwise (FULL_SHARD, SHARD_GRAD_OP) every rank loads the latest checkpoint;
   the newcomer's side of this is ``join``, called by ``run_elastic`` as its program starts;
3. otherwise the survivors decide where the state comes from:
   - a shard group all of whose ranks are alive still holds a whole replica (HYBRID_SHARD,
     NO_SHARD): those groups go on from memory, and the ranks of broken groups leave;
   - otherwise (FULL_SHARD, SHARD_GRAD_OP, or no replica left whole) every survivor loads the
     latest checkpoint, resharded onto their number; with none to load, the run cannot go on;
4. the ranks that go on build the run on their communicator, as a run started there would be
   built, and put the state in.

The same path grows a shrunk run back when hosts are added (``agreement.GrowthAgreed``): nobody
was lost, so nothing shrinks; where the newcomers' state must come from a checkpoint, the ranks
first save the committed state, so that no step is taken twice.

A rank lost during any of this (a node's ranks noticed one after the other, a second failure)
makes the survivors shrink again and start over from the same committed state: every
collective of the recovery is inside that retry. A newcomer that meets a loss before it is
healed has nothing to go on from: it leaves, and the survivors go on without growing. MPI makes a communicator's creation
(split, shrink) succeed on every rank or fail on every rank, so all survivors always retry
from the same communicator.
"""

import gc
import socket
import sys
import time
from dataclasses import dataclass, field
from typing import Callable, Generic, NoReturn, TypeVar

import torch
from mpi4py import MPI
from torch import nn

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.failures.process_end import exit_without_finalize
from fsdp_mpi.communication.failures.job import (free_slots, hosts_tried, job_comm, job_layout, job_rank,
                                                 job_ranks, places_of)
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


def newcomer_message(rank: int, step: int) -> str:
    """What a newcomer says once it has joined: its place, its step, and the host it was started on."""
    return f"rank {rank}: a newcomer in a lost rank's place, at optimizer step {step}, on {socket.gethostname()}"


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
    speaker: bool  # whether this rank says what happened (the lowest survivor)
    newcomers: list[int] = field(default_factory=list)  # the ranks of the job a grow-back filled
    saved: bool = False  # whether the state was saved at this step for the newcomers (a growth into added hosts)

    def message(self, step: int, noticed_after: float) -> str:
        newcomers = ", ".join(map(str, self.newcomers))
        if self.newcomers:
            source = ("memory (each newcomer's state sent by its twin)" if self.from_memory else
                      "a checkpoint saved at this step" if self.saved else "the latest checkpoint")
        else:
            source = "memory (the shard groups left whole)" if self.from_memory else "the latest checkpoint"
        if not self.lost:  # grown back into added hosts (``agreement.GrowthAgreed``), or tried to
            if not self.newcomers:
                return (f"hosts were added, but no newcomer could start: {self.after} rank(s) go on as they were"
                        + ("" if self.from_memory else f", from the latest checkpoint at optimizer step {step}"))
            return (f"hosts were added: grown back from {self.before} to {self.after} rank(s), newcomers in rank(s) "
                    f"{newcomers}, going on from {source} at optimizer step {step}, in {self.rebuild_seconds:.3f} s")
        grown = f", newcomers in rank(s) {newcomers}," if self.newcomers else ""
        return (f"lost rank(s) {', '.join(map(str, self.lost))} of the job ({self.before} training before); "
                f"{self.after} rank(s){grown} go on from {source} at optimizer step {step}. "
                f"Noticed after {noticed_after:.3f} s in a collective, shrunk in {self.shrink_seconds:.3f} s, "
                f"rebuilt in {self.rebuild_seconds:.3f} s")


@dataclass
class Growth:
    """What the survivors of a loss tell the newcomers they started: what was lost, and where the state comes from."""

    lost: list[int]  # the ranks lost, numbered as in the job
    before: int  # ranks training before the loss
    newcomers: list[int]  # the ranks of the job the newcomers fill
    places: list[tuple[list[int], str | None]]  # where they start: (ranks, the host, in the dead processes' places;
    # None: in free slots), as ``places_of`` says
    twins: dict[int, int] | None  # each newcomer's twin, which sends it its state; None: the latest checkpoint


@dataclass
class Plan(Generic[Run]):
    """What the loop supplies to rebuild its run on the survivors.

    build: the run built and wrapped on a communicator's ranks, exactly as a run started there is built.
    shard_comm: a run's shard group (``model.groups.shard``): whether it is whole decides the source.
    replica_comm: the ranks that hold the same shards as this one (``model.groups.replicas``; None under
        FULL_SHARD and SHARD_GRAD_OP, whose shards nobody else holds).
    held: a run's committed state (picklable: a twin sends it to a newcomer). None where the state comes back
        only from checkpoints (a Lightning Trainer's: its loops' state lives nowhere else), whatever is replicated.
    take: puts a held state into a run built with its shard groups laid out alike (each rank in its place).
    from_checkpoint: loads the latest checkpoint into the new run; False if there is none. None: the run keeps
        no checkpoints.
    save: saves a run's committed state as the latest checkpoint (collective over its ranks): before growing
        back into added hosts where the newcomers load it. None: the run keeps no checkpoints.
    release: frees what of the old run's state a reload replaces (its optimizer state), before the new run is
        built beside it: the recovery then holds one copy of the state more than a run started on the survivors
        would, not two.
    position: where a run is (its committed step, and anything else that says where it is in the data), checked
        to be the same on every rank that goes on from memory.
    grow_back: start a newcomer in each lost rank's place where the allocation has free slots, and go on with
        as many ranks as before.
    """

    build: Callable[[Communicator], Run]
    shard_comm: Callable[[Run], Communicator]
    replica_comm: Callable[[Run], Communicator | None]
    held: Callable[[Run], object] | None
    take: Callable[[Run, object], None] | None
    from_checkpoint: Callable[[Run], bool] | None
    position: Callable[[Run], object]
    release: Callable[[Run], None]
    save: Callable[[Run], None] | None = None
    grow_back: bool = False


def recover(run: Run, comm: Communicator, plan: Plan[Run], growing: bool = False) -> Recovered[Run] | Left:
    """`run`, trained on `comm`, rebuilt on the ranks that go on after a loss (collective over the survivors of
    `comm`, every one of which has abandoned the step). Raises ``CannotGoOn`` where the lost state is nowhere.
    `growing`: nobody was lost, the ranks agreed to grow back into added hosts (``GrowthAgreed``); where no
    newcomer can start, `run` goes on as it was."""
    started, before = time.perf_counter(), comm.world_size
    lost: set[int] = set()
    failing = comm  # the communicator a loss was last seen on: the next shrink's
    grow = plan.grow_back  # once a recovery: after a newcomer lost in its own heal, the survivors go on shrunk
    while True:
        if growing:  # everybody is here: nothing to shrink (a loss from now on shrinks as ever)
            survivors, alive = comm, job_ranks(comm.mpi_comm)
        else:
            survivors, alive = shrink_until_it_holds(failing)
            lost |= set(job_ranks(failing.mpi_comm)) - set(alive)
        shrunk = time.perf_counter()
        failing = survivors
        try:
            replicas = plan.replica_comm(run)
            # Each survivor's shard group and replicas, as ranks of the job: (shard group, replicas or None).
            groups = survivors.all_gather_object((job_ranks(plan.shard_comm(run).mpi_comm),
                                                  job_ranks(replicas.mpi_comm) if replicas is not None else None))
            if grow:
                grow = False
                growth = _growth(groups, alive, sorted(lost), before, in_memory=plan.held is not None)
                saved = growing and growth.twins is None and plan.save is not None
                if saved:
                    plan.save(run)  # the newcomers load the committed state, not the last periodic save
                job = _grown_back(survivors, growth) if growth.twins is not None or plan.from_checkpoint else None
                if job is not None:
                    failing = job
                    job.all_gather_object(growth)  # the newcomers' ``join`` learns it here
                    rebuilt = _rebuild(run, job, growth.twins is not None, plan, growth.twins or {})
                    job.watch_liveness()
                    return Recovered(rebuilt, sorted(lost), before, job.world_size, growth.twins is not None,
                                     shrunk - started, time.perf_counter() - shrunk, job.rank == min(alive),
                                     growth.newcomers, saved)
            if growing:  # no newcomer could start: as it was, until the hosts file changes again
                hosts_tried()
                # A run whose state only checkpoints hold (a Trainer left in the middle of its fit) cannot be
                # taken up where the growth interrupted it: it is built again, from the latest checkpoint.
                as_it_was = run if plan.held is not None else _rebuild(run, survivors, False, plan, {})
                return Recovered(as_it_was, [], before, before, plan.held is not None, 0.0,
                                 time.perf_counter() - shrunk, survivors.rank == 0)
            whole = [set(shard) <= set(alive) for shard, _ in groups]
            from_memory = plan.held is not None and replicas is not None and any(whole)
            if from_memory and not whole[survivors.rank]:
                survivors.split(MPI.UNDEFINED)
                return Left(sorted(lost))
            if not from_memory and plan.from_checkpoint is None:
                raise CannotGoOn(f"lost rank(s) {', '.join(map(str, sorted(lost)))}, and no shard group is left "
                                 "whole to go on from memory nor a checkpoint directory to reload",
                                 survivors.rank == 0)
            going_on = survivors.split(0) if from_memory else survivors
            failing = going_on
            rebuilt = _rebuild(run, going_on, from_memory, plan, {})
            going_on.watch_liveness()
            return Recovered(rebuilt, sorted(lost), before, going_on.world_size, from_memory, shrunk - started,
                             time.perf_counter() - shrunk, going_on.rank == 0)
        except RankLostError:
            growing = False  # a loss after all
            continue  # shrink `failing` again, from the same committed state


def join(job: Communicator, plan: Plan[Run]) -> Recovered[Run]:
    """A newcomer's side of a grow-back (``recover`` on the survivors), on the job it has joined (collective over
    it): the run built in its place, its state from its twin or the latest checkpoint. A loss before it is healed
    ends this process (it has nothing to go on from; the survivors go on without it)."""
    started = time.perf_counter()
    try:
        growth = next(told for told in job.all_gather_object(None) if told is not None)
        rebuilt = _rebuild(None, job, growth.twins is not None, plan, growth.twins or {})
        job.watch_liveness()
    except RankLostError as lost:
        print(f"fsdp_mpi.elastic: the newcomer in rank {job.rank}'s place leaves: a rank was lost before it was "
              f"healed ({lost})", file=sys.stderr, flush=True)
        exit_without_finalize(0)
    # The ranks it replaced were lost too (earlier, where hosts added made the run grow back).
    return Recovered(rebuilt, sorted(set(growth.lost) | set(growth.newcomers)), growth.before, job.world_size,
                     growth.twins is not None, 0.0, time.perf_counter() - started, False, growth.newcomers)


def _growth(groups: list[tuple[list[int], list[int] | None]], alive: list[int], lost: list[int],
            before: int, in_memory: bool) -> Growth:
    """Who the newcomers are (every rank of the job not alive, lost now or earlier) and where their state comes
    from: their twins (the lowest survivor holding the same shards), where every newcomer has one and the state
    can move `in_memory`. `groups`: each survivor's shard group and replicas, as ranks of the job."""
    size = job_comm().Get_size()
    missing = sorted(set(range(size)) - set(alive))
    here = {survivor: (shard.index(survivor), len(shard)) for survivor, (shard, _) in zip(alive, groups)}
    # Every rank's place that the survivors' groups show (a replica is at its holder's), kept where they show the
    # whole job: a run shrunk to one shard group has no replicas, but a newcomer joining it has a twin there.
    layout = job_layout({**{rank: here[survivor] for survivor, (_, replicas) in zip(alive, groups)
                            for rank in replicas or []},
                         **{rank: (shard.index(rank), len(shard)) for shard, _ in groups for rank in shard}})
    twins = {}
    if in_memory and all(layout.get(survivor) == here[survivor] for survivor in alive):  # each keeps its own
        for rank in missing:
            holders = [survivor for survivor in alive if here[survivor] == layout.get(rank)]
            if holders and layout[rank][1] < size:  # a shard group smaller than the job: the state is replicated
                twins[rank] = min(holders)
    return Growth(lost, before, missing, places_of(missing, alive), twins if len(twins) == len(missing) else None)


def _grown_back(survivors: Communicator, growth: Growth) -> Communicator | None:
    """The job grown back by `growth`'s newcomers, or None where they cannot start (said once): they need free
    slots and the allocation has too few (asked first: Open MPI's launcher fails the whole job at its end after a
    refused spawn), or MPI refused."""
    # Rank 0's count for all: the hosts file it reads may change while the others would read it.
    free = survivors.all_gather_object(free_slots() if survivors.rank == 0 else None)[0]
    needed = sum(len(ranks) for ranks, host in growth.places if host is None)
    try:
        if free is not None and free < needed:
            raise CannotGrow(f"{needed} free slot(s) needed, {free} in the allocation")
        return survivors.grow_back(growth.places)
    except (CannotGrow, MPI.Exception) as refused:
        if survivors.rank == 0:
            why = refused.Get_error_string() if isinstance(refused, MPI.Exception) else str(refused)
            print(f"fsdp_mpi.elastic: no newcomer can start in the place of rank(s) "
                  f"{', '.join(map(str, growth.newcomers))} ({why}): the run goes on without; to grow back, give "
                  "mpirun more slots than ranks, or add hosts to the hosts file (docs/failures.md)", file=sys.stderr,
                  flush=True)
        return None


class CannotGrow(RuntimeError):
    """The newcomers a grow-back needs cannot start."""


def _rebuild(run: Run | None, going_on: Communicator, from_memory: bool, plan: Plan[Run],
             twins: dict[int, int]) -> Run:
    """`run`'s committed state in a run built on `going_on`'s ranks, from memory or the latest checkpoint; on a
    newcomer (`run` None, its place in `twins`, which maps each newcomer to its twin), its twin's state."""
    if run is not None and not from_memory:  # a second loss only ever leaves fewer groups whole: the old state
        plan.release(run)  # is not read again
    gc.collect()  # the interrupted step's frames (its activations) and an earlier run's cycles, before the build
    give_back_freed_host_memory()
    rebuilt = plan.build(going_on)
    if from_memory:
        positions = [where for where in going_on.all_gather_object(plan.position(run) if run is not None else None)
                     if where is not None]
        if any(where != positions[0] for where in positions):  # the agreement before every update rules it out
            raise RuntimeError(f"the ranks going on from memory stand at different places {positions}: their "
                               "states differ, so none of them can be trusted")
        if run is not None:
            plan.take(rebuilt, plan.held(run))
        for newcomer, twin in twins.items():
            if going_on.rank == twin:
                going_on.send_object(plan.held(run), newcomer)
            elif going_on.rank == newcomer:
                plan.take(rebuilt, going_on.receive_object(twin))
    elif not plan.from_checkpoint(rebuilt):
        raise CannotGoOn("no checkpoint has been saved yet to reload the lost shards from", going_on.rank == 0)
    return rebuilt


def collect_the_old_run() -> None:
    """Frees the run a recovery replaced, once the loop holds only the new one: the old run lives on in its
    reference cycles (model, hooks, communicator, node memory) until Python's next full collection, one more
    copy of the state through the steps after the loss."""
    gc.collect()


def shards_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's shard of every parameter of the wrapped `model`, by name (for ``put_shards``)."""
    return {name: parameter.detach() for name, parameter in model.named_parameters()}


def put_shards(model: nn.Module, shards: dict[str, torch.Tensor]) -> None:
    """Copies `shards` (``shards_of`` a model built alike) into the wrapped `model`, built on the ranks that go on
    with shard groups laid out as the old one's (the same size, each rank in its place: each shard has the same
    elements)."""
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name, shard in shards.items():
            if parameters[name].shape != shard.shape:
                raise RuntimeError(f"{name}'s shard has {tuple(shard.shape)} elements in the state kept but "
                                   f"{tuple(parameters[name].shape)} in the run going on: the shard groups "
                                   "changed, so the state cannot move from memory")
            parameters[name].copy_(shard)


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
            return survivors, survivors.all_gather_object(job_rank())
        except RankLostError:
            comm = survivors

"""--keep-going: a run that loses ranks goes on with the survivors, in the same job, at the same sample.

Under Open MPI started with ``mpirun --with-ft ulfm --mca btl tcp,self``, a rank's
death reaches every survivor as ``fsdp_mpi.RankLostError`` from its next call that
involves the dead rank, or from a survivor's revocation (``fsdp_mpi.communication.failures.lost_ranks``).
Then every survivor:

1. shrinks the world to the ranks still alive (``Communicator.shrink``);
2. decides, with the others, where the training state comes from:
   - a shard group all of whose ranks are alive still holds a whole replica of
     the model and optimizer (HYBRID_SHARD, NO_SHARD): those groups go on from
     memory, from the step the loss interrupted, and the ranks of broken groups
     leave (they end with exit code 0);
   - otherwise (FULL_SHARD, SHARD_GRAD_OP, or no replica left whole) every
     survivor reloads the latest checkpoint, resharded onto their number;
3. rebuilds the model, optimizer, schedule and CSV recorder on the ranks that
   go on, exactly as a run started there would, and puts the state in.

The global batch stays that of the ranks the run started on (each step takes as
many micro-batches as its samples need), and dropout follows the sample, so the
steps after the loss compute what a run without it computes. No survivor can
have taken the interrupted step while another has not: the loop agrees
(``Communicator.agree``, uniform over the survivors) before each optimizer step.
"""

import os
import sys
import time
from dataclasses import dataclass

from mpi4py import MPI

from training.choices import REPLICATED
from training.resume import Position, RunCheckpoints

from fsdp_mpi import RankLostError


_lost_ranks_here = False  # whether this process has gone on without a rank (set by go_on_without_the_lost)


def lost_a_rank() -> bool:
    """Whether this process has lost a rank of its job and gone on (or left)."""
    return _lost_ranks_here


def exit_without_finalize(code: int):
    """Ends this process with `code` at once, its output flushed, without ``MPI_Finalize``: after a lost rank,
    Open MPI 5.0.11's finalize now and then waits forever (a survivor hung there once in about twelve 6-rank
    runs), and a ULFM job is content with a process that ends without it."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class Left:
    """This rank's shard group lost a rank while another went on: it leaves the run."""

    lost: list[int]  # the ranks lost, numbered as in the job
    step: int

    exit_code = 0

    def message(self) -> str:
        return (f"left the run at optimizer step {self.step}: its shard group lost rank(s) "
                f"{', '.join(map(str, self.lost))}, and the groups left whole go on")


def go_on_without_the_lost(run, position: Position, lost: RankLostError, start_run):
    """After `lost`: the run rebuilt on the ranks that go on, and where it is (``(run, position)``), or ``Left``.
    Collective over the survivors. `start_run` builds a run on a communicator (``loop.start_run``). A rank lost
    while the survivors rebuild (a node's ranks noticed one after the other, or a second failure) makes them
    shrink again and rebuild from the same state: `run`'s memory, or the checkpoint."""
    global _lost_ranks_here
    _lost_ranks_here = True
    noticed = time.perf_counter()
    world, before = run.comm, run.comm.world_size
    lost_ranks: set[int] = set()
    while True:
        survivors, alive = _shrink_until_it_holds(world)
        shrunk = time.perf_counter()
        lost_ranks |= set(_job_ranks(world.mpi_comm)) - set(alive)
        whole = survivors.all_gather_object(set(_job_ranks(run.prepared.model.groups.shard.mpi_comm)) <= set(alive))
        from_memory = run.config.sharding_strategy in REPLICATED and any(whole)
        if from_memory and not whole[survivors.rank]:
            survivors.split(MPI.UNDEFINED)
            return Left(sorted(lost_ranks), position.step)
        if not from_memory and not run.config.checkpoint_dir:
            if survivors.rank == 0:
                print(f"--keep-going: lost rank(s) {', '.join(map(str, sorted(lost_ranks)))}, and no shard group is "
                      f"left whole to go on from memory nor a --checkpoint-dir to reload: the run ends here",
                      file=sys.stderr, flush=True)
            exit_without_finalize(2)
        going_on = survivors.split(0) if from_memory else survivors
        try:
            rebuilt, resumed_at = _rebuild(run, position, going_on, from_memory, start_run)
            break
        except RankLostError:
            world = going_on  # the ranks that leave have left: only these shrink
    if going_on.rank == 0:
        source = "memory (the shard groups left whole)" if from_memory else "the latest checkpoint"
        print(f"--keep-going: lost rank(s) {', '.join(map(str, sorted(lost_ranks)))} of the job ({before} training "
              f"before); {going_on.world_size} rank(s) go on from {source} at optimizer step {resumed_at.step}. "
              f"Noticed after {lost.waited:.3f} s in a collective, shrunk in {shrunk - noticed:.3f} s, rebuilt in "
              f"{time.perf_counter() - shrunk:.3f} s ({lost})", flush=True)
    return rebuilt, resumed_at


def _rebuild(run, position: Position, going_on, from_memory: bool, start_run):
    """`run` built again on `going_on`'s ranks, with `run`'s state or the latest checkpoint's: (run, position)."""
    rebuilt = start_run(run.task, run.config, going_on, run.device, run.experiment, run.batching)
    if from_memory:
        rebuilt.recorder.resume(run.recorder.run_id, run.recorder.rows, run.recorder.step_rows)
        _move_state(run, rebuilt)
    else:  # the checkpoint holds the rows too
        position = RunCheckpoints(rebuilt).restore()
    going_on.watch_liveness()
    return rebuilt, position


def _shrink_until_it_holds(comm):
    """`comm`'s survivors and their ranks in the job (``MPI.COMM_WORLD``), shrunk again if a rank is lost
    meanwhile (a node's ranks may be noticed one after the other)."""
    while True:
        survivors = comm.shrink()
        try:
            return survivors, survivors.all_gather_object(MPI.COMM_WORLD.Get_rank())
        except RankLostError:
            comm = survivors


def _job_ranks(mpi_comm) -> list[int]:
    """The ranks of `mpi_comm`, numbered as in the job (``MPI.COMM_WORLD``), as launchers and logs number them."""
    return mpi_comm.Get_group().Translate_ranks(list(range(mpi_comm.Get_size())), MPI.COMM_WORLD.Get_group())


def _move_state(old, new) -> None:
    """Puts `old`'s shards, optimizer state, schedule and loss scale into `new`, whose shard groups are laid out
    as `old`'s (the same size, each rank in its place): every parameter's shard has the same elements."""
    new_parameters = dict(new.prepared.model.named_parameters())
    for name, parameter in old.prepared.model.named_parameters():
        if new_parameters[name].shape != parameter.shape:
            raise RuntimeError(f"--keep-going: {name}'s shard has {tuple(parameter.shape)} elements here but "
                               f"{tuple(new_parameters[name].shape)} on the ranks left: the shard groups changed")
        new_parameters[name].data.copy_(parameter.data)
    new.optimizer.load_state_dict(old.optimizer.state_dict())
    new.schedule.load_state_dict(old.schedule.state_dict())
    new.prepared.scaler.load_state_dict(old.prepared.scaler.state_dict())

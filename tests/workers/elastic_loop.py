"""A user's own training loop under ``fsdp_mpi.run_elastic``, a Hugging Face GPT-2 in it, with ranks killed at
chosen moments, for tests/test_elastic.py.

    python elastic_loop.py OUT [--strategy NAME] [--checkpoint-every N] [--accumulate] [--overlap] [--offload]
                           [--grow-back] [--add-hosts STEP:HOST:SLOTS] [--kill RANK:STEP:MOMENT]...
                           [--kill-newcomer RANK:STEP:MOMENT]...

The loop is what docs/failures.md shows a user: every step's samples follow from ``state.step`` (a global batch
of GLOBAL_BATCH, cut into equal parts on the ranks of the moment), and every step ends in ``state.commit()``.
With --checkpoint-every, checkpoints go to OUT/checkpoints. --accumulate
takes each step as two micro-batches, the first under ``no_sync()``; --overlap turns on the prefetches and the
asynchronous reduce-scatter (so a collective is in flight when a rank dies); --offload keeps the shards in host
memory (``CPUOffload``); --grow-back starts a newcomer in each lost rank's place (``run_elastic(grow_back=True)``):
the newcomer runs this program with these arguments, and only its own --kill-newcomer plans apply to it.
--add-hosts gives the run OUT/hosts as its hosts file, and rank 0 writes HOST:SLOTS into it once STEP steps are
committed (as a user adding a host while the run goes on), over what was there. RANK is
the rank in the job, STEP the optimizer step (from 0; for save and latest, the steps the checkpoint holds), MOMENT
one of:

    start      (STEP -1) as the run is first built (the others are in the wrapper's collectives)
    backward   the step's second unit hook in backward (the others are in its collectives)
    unscale    as the loss scaler's found-inf reduction starts (the others are in it)
    agreement  as the rank enters the step's agreement (the others are inside it)
    save       as the checkpoint save after the step starts (the others are in its collectives)
    latest     rank 0, between the checkpoint's rename and ``latest`` naming it
    shrink     as the survivors of an earlier loss start to shrink (the others are inside MPI's shrink)
    recovery   right after the survivors of an earlier loss shrank (the others are in the recovery's all-gather)
    heal       a newcomer, as its state is put in (its twin has sent it; the others are in the recovery)

The rank sends itself SIGKILL, as a node that dies (each plan once in the run). GLOBAL_BATCH is cut into equal parts on 1, 2, 3, 4 or 6 ranks. At the end rank 0 of the ranks left writes OUT/result.json:
each step's loss (the mean over the global batch) and number of ranks, the loss of a fixed batch after the last step, the
recoveries, and how many threads and communicators the process holds, after the first step, at the end, and at
the first step after each recovery: there without a collection first, with how many models built before the
current one are still alive (the old run must be gone at once, not at Python's next full collection).
"""

import contextlib
import gc
import json
import os
import signal
import sys
import threading
import weakref
from pathlib import Path

import torch
from transformers import GPT2Config, GPT2LMHeadModel
from transformers.models.gpt2.modeling_gpt2 import GPT2Block

import fsdp_mpi
from fsdp_mpi import (CPUOffload, Elastic, ElasticState, FullyShardedDataParallel as FSDP, ModuleWrapPolicy,
                      ShardedGradScaler, ShardingStrategy)
from fsdp_mpi.communication import timing_points
from fsdp_mpi.communication.failures.job import is_newcomer, job_rank
from fsdp_mpi.elastic import recovery, state as elastic_state
from fsdp_mpi.files import checkpoint_directory

STEPS, GLOBAL_BATCH, SEQ, VOCAB = 6, 12, 16, 64


def build(comm: fsdp_mpi.Communicator, strategy: ShardingStrategy, options: list[str], killer: "Killer",
          models: list) -> ElasticState:
    """The same model on every rank, wrapped on `comm`'s ranks: one unit per block (a weak reference to it
    added to `models`)."""
    killer.reached("start")  # the others are in the wrapper's collectives
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    overlap = "--overlap" in options
    model = FSDP(GPT2LMHeadModel(config), comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}),
                 sharding_strategy=strategy, device=torch.device("cpu"), forward_prefetch=overlap,
                 backward_prefetch=overlap, async_reduce_scatter=overlap,
                 cpu_offload=CPUOffload(offload_params=True) if "--offload" in options else None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    # A loss scaler, as fp16 needs (its scale a power of 2: the same numbers in fp32): its found-inf reduction
    # is a collective, which must come before the step's agreement.
    models.append(weakref.ref(model))
    return ElasticState(model, optimizer, scaler=ShardedGradScaler(comm), losses=[], ranks=[])


def tokens(first: int, count: int) -> torch.Tensor:
    """Samples first .. first + count - 1, each drawn from its own index (the same on any number of ranks): a run
    of tokens with a start and a stride of its own, which the model learns to continue, so that every update
    shows in the losses that follow."""
    samples = []
    for index in range(first, first + count):
        start, stride = torch.randint(VOCAB, (2,), generator=torch.Generator().manual_seed(index)).tolist()
        samples.append((start + (1 + stride % 3) * torch.arange(SEQ)) % VOCAB)
    return torch.stack(samples)


def train(state: ElasticState, killer: "Killer", seen: dict, micro_batches: int,
          hosts_added: tuple[int, Path, str] | None) -> ElasticState:
    comm = state.comm
    per_rank = GLOBAL_BATCH // comm.world_size  # (B, SEQ) below, B = per_rank
    while state.step < STEPS:
        killer.step = state.step
        batch = tokens(state.step * GLOBAL_BATCH + comm.rank * per_rank, per_rank)
        loss_sum = 0.0
        for index, micro in enumerate(batch.chunk(micro_batches)):
            with state.model.no_sync() if index < micro_batches - 1 else contextlib.nullcontext():
                loss = state.model(input_ids=micro, labels=micro).loss / micro_batches
                state.scaler.scale(loss).backward()
            loss_sum += loss.item()
        state.counters["losses"].append(comm.all_reduce_sum_float(loss_sum) / comm.world_size)
        state.counters["ranks"].append(comm.world_size)
        state.commit()
        if hosts_added and state.step == hosts_added[0] and comm.rank == 0:
            hosts_added[1].write_text(f"# the hosts the job may grow into\n{hosts_added[2]}\n")
        if "after_first_step" not in seen:
            seen["after_first_step"], seen["models_then"] = resources(), len(seen["models"])
        elif len(seen["models"]) > seen["models_then"] + len(seen["after_recoveries"]):  # a rebuilt run's first
            older = seen["models"][:-1]
            seen["after_recoveries"].append({**resources(collect=False),
                                             "old_models_alive": sum(model() is not None for model in older)})
    return state


def resources(collect: bool = True) -> dict:
    """What a run that lost ranks must not pile up: threads, open files (the node transport's shared memory is
    a file each), mapped shared memory, communicators still alive (after a full collection where `collect`)."""
    if collect:
        gc.collect()
    with open("/proc/self/maps") as maps:
        shared = sum(1 for line in maps if "memfd:" in line or "/dev/shm" in line)
    return {"threads": sorted(thread.name for thread in threading.enumerate()),
            "files": len(os.listdir("/proc/self/fd")), "shared_mappings": shared,
            "communicators": sum(isinstance(thing, fsdp_mpi.Communicator) for thing in gc.get_objects())}


class Killer:
    """Kills this rank at its planned (step, moment), once in the run: a plan carried out leaves a file in
    `out`, so that the newcomer taking this rank's place later does not carry it out again."""

    def __init__(self, plan: set[tuple[int, str]], out: Path):
        self.plan, self.out, self.step, self.hooks = plan, out, -1, {}
        self.saving = -1  # the step whose checkpoint is being saved

    def reached(self, moment: str) -> None:
        step = self.saving if moment in ("save", "latest") else self.step
        done = self.out / f"killed-{job_rank()}-{step}-{moment}"
        if (step, moment) in self.plan and not done.exists():
            done.touch()
            print(f"rank {job_rank()}: killed in step {self.step}'s {moment}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    # timing_points' listener
    def enter(self, point: str) -> None:
        if point == timing_points.HOOK and not torch.is_grad_enabled():  # autograd runs backward's hooks so
            self.hooks[self.step] = self.hooks.get(self.step, 0) + 1
            if self.hooks[self.step] == 2:
                self.reached("backward")

    def leave(self, point: str) -> None:
        pass

    def collective_started(self, record) -> None:
        pass


def install(killer: Killer) -> None:
    """Puts the killer where each moment happens."""
    timing_points.add_listener(killer)
    end_step, save, save_checkpoint = elastic_state.end_step, checkpoint_directory.CheckpointDirectory.save, \
        checkpoint_directory.save_checkpoint
    shrink, unscale, take = recovery.shrink_until_it_holds, ShardedGradScaler.unscale_, ElasticState.take

    def agreeing(comm, interrupted=None):
        killer.reached("agreement")
        return end_step(comm, interrupted)

    def saving(self, step, *args):
        killer.saving = step
        killer.reached("save")
        return save(self, step, *args)

    def renamed(*args, **kwargs):
        done = save_checkpoint(*args, **kwargs)
        killer.reached("latest")
        return done

    def unscaling(self, optimizer):
        killer.reached("unscale")
        return unscale(self, optimizer)

    def healing(self, held):
        killer.reached("heal")
        return take(self, held)

    def shrunk(comm):
        killer.reached("shrink")
        found = shrink(comm)
        killer.reached("recovery")
        return found

    elastic_state.end_step, checkpoint_directory.CheckpointDirectory.save = agreeing, saving
    checkpoint_directory.save_checkpoint, recovery.shrink_until_it_holds = renamed, shrunk
    ShardedGradScaler.unscale_, ElasticState.take = unscaling, healing


def main() -> None:
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    strategy = ShardingStrategy[args[args.index("--strategy") + 1]] if "--strategy" in args else \
        ShardingStrategy.FULL_SHARD
    every = int(args[args.index("--checkpoint-every") + 1]) if "--checkpoint-every" in args else 0
    rank, kill = job_rank(), "--kill-newcomer" if is_newcomer() else "--kill"  # a newcomer: once it joined
    plan = {(int(step), moment) for victim, step, moment in
            (args[i + 1].split(":") for i, word in enumerate(args) if word == kill) if int(victim) == rank}
    killer = Killer(plan, out)
    install(killer)
    elastic, seen = Elastic(), {"models": [], "after_recoveries": []}
    micro_batches = 2 if "--accumulate" in args else 1
    adding = args[args.index("--add-hosts") + 1].split(":", 1) if "--add-hosts" in args else None
    hosts_added = (int(adding[0]), out / "hosts", adding[1]) if adding else None
    state = fsdp_mpi.run_elastic(lambda state: train(state, killer, seen, micro_batches, hosts_added),
                                 lambda comm: build(comm, strategy, args, killer, seen["models"]),
                                 checkpoint_dir=out / "checkpoints" if every else None, checkpoint_every=every,
                                 elastic=elastic, grow_back="--grow-back" in args,
                                 hosts_file=hosts_added[1] if hosts_added else None)
    if state is not None:
        with torch.no_grad():  # the weights after the last step, on a batch no step trained on
            per_rank = GLOBAL_BATCH // state.comm.world_size
            batch = tokens(10_000 + state.comm.rank * per_rank, per_rank)
            held_out = state.comm.all_reduce_sum_float(state.model(input_ids=batch, labels=batch).loss.item())
        del state.optimizer, state.model  # the last run's own communicator stays; the ones before must be gone
        if state.comm.rank == 0:
            result = {"losses": state.counters["losses"], "step_ranks": state.counters["ranks"], "held_out": held_out / state.comm.world_size,
                      "recoveries": elastic.recoveries, "ranks": state.comm.world_size,
                      "after_first_step": seen.get("after_first_step"), "at_the_end": resources(),
                      "after_recoveries": seen["after_recoveries"]}
            (out / "result.json").write_text(json.dumps(result, indent=1))
    if elastic.lost_ranks:
        fsdp_mpi.exit_without_finalize(0)


if __name__ == "__main__":
    main()

"""Ranks that diverge: each mode ends with a clear error, or (even_batches, verified) does not diverge at all.

    mpiexec -n 2 python hangs.py OUT MODE

uneven       rank 0 trains one step more than rank 1 (run with FSDP_MPI_TIMEOUT set: the watchdog ends it)
stalled      rank 1 stops outside MPI (a long sleep) after two steps, alive: rank 0's watchdog hears it answer
unit_order   rank 1 runs two same-shaped blocks in the other order, under verify mode
even_batches ranks hold 5, 3, 4, ... batches; even_batches stops all of them after 3
verified     a training loop using every switch, with and without verify mode: the same losses
kill         rank 1 SIGKILLs itself in the middle of training
forever      every rank writes its pid to OUT.pids.<rank> and trains until stopped from outside
"""

import os
import signal
import sys
import time
import warnings

import torch
from common import output_path, write_json

from fsdp_mpi import (Communicator, FullyShardedDataParallel, ModuleWrapPolicy, clip_grad_norm_, even_batches,
                      full_state_dict)
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config


def gpt2(comm: Communicator, **options) -> FullyShardedDataParallel:
    torch.manual_seed(0)
    return FullyShardedDataParallel(GPT2LMHeadModel(gpt2_config("gpt2-tiny")), comm=comm,
                                    auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), **options)


def train_step(model, step: int) -> float:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, model.config.vocab_size, (2, 17), generator=generator)
    _, loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.item()


class TwoBlocks(torch.nn.Module):
    """Two blocks of one shape; `reverse` runs them in the other order."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))

    def forward(self, x, reverse: bool):
        for block in (reversed(self.blocks) if reverse else self.blocks):
            x = block(x)
        return x.sum()


def verified_losses(verify: bool) -> list[float]:
    comm = Communicator(verify=verify)
    model = gpt2(comm, forward_prefetch=True, backward_prefetch=True, async_reduce_scatter=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(3):
        with model.no_sync():
            train_step(model, 100 + step)
        losses.append(train_step(model, step))
        clip_grad_norm_(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
    full_state_dict(model)
    return losses


if __name__ == "__main__":
    mode = sys.argv[2]
    comm = Communicator()
    report = {}
    if mode == "uneven":
        model = gpt2(comm)
        for step in range(3 if comm.rank == 0 else 2):
            train_step(model, step)
        print(f"rank {comm.rank} left the training loop", flush=True)
    elif mode == "stalled":
        model = gpt2(comm)
        for step in range(3):
            if comm.rank == 1 and step == 2:
                time.sleep(120)
            train_step(model, step)
    elif mode == "unit_order":
        torch.manual_seed(0)
        model = FullyShardedDataParallel(TwoBlocks(), comm=Communicator(verify=True),
                                         auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}))
        model(torch.ones(2, 8), reverse=comm.rank == 1).backward()
    elif mode == "even_batches":
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            taken = list(even_batches(range([5, 3, 4, 6][comm.rank % 4]), comm))
        report = {"taken": comm.all_gather_object(taken), "warnings": [str(w.message) for w in caught]}
    elif mode == "raise_alone":  # each rank holds its model alone; rank 0 fails while rank 1 waits for it
        model = gpt2(comm.split(comm.rank))
        train_step(model, 0)
        if comm.rank == 0:
            raise RuntimeError("rank 0 fails on purpose")
        comm.barrier()
    elif mode == "verified":
        report = {"plain": verified_losses(False), "verified": verified_losses(True)}
    elif mode in ("kill", "forever"):
        model = gpt2(comm)
        with open(f"{output_path()}.pids.{comm.rank}", "w") as pids:
            pids.write(str(os.getpid()))
        for step in range(10**6):
            train_step(model, step)
            if mode == "kill" and step == 2 and comm.rank == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.05)
    if comm.rank == 0:
        write_json(output_path(), report)

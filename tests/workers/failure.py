"""Rank 1 raises in the middle of a training step while the others go on into collectives."""

import sys

import torch
from common import gpt_batch

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config

if __name__ == "__main__":
    comm = Communicator()
    torch.manual_seed(0)
    model = FullyShardedDataParallel(GPT2LMHeadModel(gpt2_config("gpt2-tiny")), comm=comm,
                                     auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    for step in range(1000):
        inputs, targets = gpt_batch(step, 128, global_batch=2)
        _, loss = model(inputs, targets)
        if comm.rank == 1 and step == 2:
            raise RuntimeError("injected failure on rank 1")
        loss.backward()
    sys.exit("the job should have been aborted")

"""Wrapping input that must fail cleanly on every rank: argv[2] names the case."""

import sys

from torch import nn

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy
from fsdp_mpi_models.gpt2 import GPT2LMHeadModel, gpt2_config

if __name__ == "__main__":
    comm = Communicator()
    case = sys.argv[2]
    if case == "different_models":
        width = 16 + comm.rank  # rank 1 builds a wider layer
        FullyShardedDataParallel(nn.Sequential(nn.Linear(4, width), nn.Linear(width, 2)), comm=comm)
    elif case == "tied_split":
        model = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
        FullyShardedDataParallel(model, comm=comm, auto_wrap_policy=ModuleWrapPolicy({nn.Embedding}))
    sys.exit(f"case {case!r} did not raise")

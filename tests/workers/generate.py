"""Sampling from an FSDP-wrapped GPT-2 on every rank gives the tokens the plain model gives."""

import copy

import torch
from common import output_path, write_json

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy
from models.gpt2 import GPT2Block, GPT2LMHeadModel, generate, gpt2_config

if __name__ == "__main__":
    comm = Communicator()
    torch.manual_seed(0)
    plain = GPT2LMHeadModel(gpt2_config("gpt2-tiny"))
    sharded = FullyShardedDataParallel(copy.deepcopy(plain), comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    prompt = torch.tensor([[1, 2, 3]])
    from_sharded = generate(sharded, prompt, 12, top_k=10, generator=torch.Generator().manual_seed(5))
    from_plain = generate(plain, prompt, 12, top_k=10, generator=torch.Generator().manual_seed(5))
    same_everywhere = comm.allgather_object(from_sharded.tolist())
    write_json(output_path(), {
        "matches_plain": torch.equal(from_sharded, from_plain),
        "same_on_all_ranks": all(tokens == same_everywhere[0] for tokens in same_everywhere),
        "length": from_sharded.shape[1],
    })

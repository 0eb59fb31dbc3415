"""A minimal fsdp_mpi training run: a tiny GPT-2 learns to copy token sequences.

    mpiexec -n 2 python experiments/quickstart.py

Every rank builds the same model; FullyShardedDataParallel makes one unit per
block and keeps 1/N of every unit on each rank. Rank 0 prints the loss.
"""

import argparse

import torch

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config


def copy_task_batch(generator: torch.Generator, batch: int, half: int, vocab: int):
    """Sequences 'x x' where the second half repeats the first: predictable only by attending back."""
    first = torch.randint(0, vocab, (batch, half), generator=generator)
    tokens = torch.cat([first, first], dim=1)
    return tokens[:, :-1], tokens[:, 1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch-per-rank", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)

    comm = Communicator()
    torch.manual_seed(args.seed)
    config = gpt2_config("gpt2-tiny", vocab_size=16)
    model = FullyShardedDataParallel(GPT2LMHeadModel(config), comm=comm, auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    local_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    if comm.rank == 0:
        print(f"{comm.world_size} ranks, {local_bytes:,} parameter bytes per rank")

    generator = torch.Generator().manual_seed(args.seed * 1000 + comm.rank)  # each rank its own data
    for step in range(1, args.steps + 1):
        inputs, targets = copy_task_batch(generator, args.batch_per_rank, 16, config.vocab_size)
        _, loss = model(inputs, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        mean_loss = comm.all_reduce_sum_float(loss.item()) / comm.world_size
        if comm.rank == 0 and (step % 25 == 0 or step == 1):
            print(f"step {step:4d}  loss {mean_loss:.3f}")


if __name__ == "__main__":
    main()

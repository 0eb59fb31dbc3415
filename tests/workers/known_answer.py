"""Linear regression y = w . f with a known w (argv[2:]), samples split across ranks: the fit must recover w."""

import sys

import torch
from common import local_part, output_path, write_json
from torch import nn

from fsdp_mpi import Communicator, FullyShardedDataParallel

if __name__ == "__main__":
    comm = Communicator()
    generator = torch.Generator().manual_seed(7)
    true_weights = torch.tensor([float(w) for w in sys.argv[2:]])
    features = torch.randn(240, len(true_weights), generator=generator)
    targets = features @ true_weights
    torch.manual_seed(0)
    model = FullyShardedDataParallel(nn.Linear(len(true_weights), 1, bias=False), comm=comm)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    local_features = local_part(features, comm.rank, comm.world_size)
    local_targets = local_part(targets, comm.rank, comm.world_size)
    for _ in range(300):
        loss = ((model(local_features).squeeze(1) - local_targets) ** 2).mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    state = model.state_dict()
    if comm.rank == 0:
        write_json(output_path(), {"weights": state["weight"].view(-1).tolist()})

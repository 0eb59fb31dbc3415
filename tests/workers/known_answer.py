"""Linear regression with noisy targets y = w . f + e, samples split across ranks (argv[2:]: w).

The fit must reach the least-squares solution of *all* samples, which the noise
moves away from w: a rank fitting only its own samples would land on its own,
different solution. Writes the fitted weights and the float64 least-squares answer.
"""

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
    targets = features @ true_weights + 0.5 * torch.randn(240, generator=generator)
    least_squares = torch.linalg.lstsq(features.double(), targets.double().unsqueeze(1)).solution.view(-1)
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
        write_json(output_path(), {"weights": state["weight"].view(-1).tolist(),
                                   "least_squares": least_squares.tolist()})

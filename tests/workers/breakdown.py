"""experiments/measuring/breakdown.py on 2 ranks: rank 1 sleeps in its forward just before a unit's
all-gather, so rank 0 enters that all-gather ``SLEEP_S`` earlier. Rank 0 must count the sleep as MPI
waiting for the slower rank, rank 1 as its own compute. Writes every rank's parts of the step."""

import sys
import time
from pathlib import Path

import torch
from common import output_path, write_json
from torch import nn

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
from measuring.breakdown import StepBreakdown  # noqa: E402

SLEEP_S = 0.5


class SleepThenLinear(nn.Module):
    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.linear = nn.Linear(64, 64)

    def forward(self, x):
        time.sleep(self.seconds)
        return self.linear(x)


def main() -> None:
    comm = Communicator()
    breakdown = StepBreakdown()
    breakdown.install()
    torch.manual_seed(0)
    model = FullyShardedDataParallel(nn.Sequential(SleepThenLinear(SLEEP_S if comm.rank == 1 else 0.0),
                                                   nn.Linear(64, 64)),
                                     comm=comm, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    inputs = torch.randn(8, 64)

    def step():
        model(inputs).square().sum().backward()

    step()  # warm-up
    comm.barrier()
    mpi_before = comm.seconds_in_mpi
    breakdown.start_step()
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    recorded = breakdown.end_step()
    mpi_seconds = comm.seconds_in_mpi - mpi_before
    parts = StepBreakdown.parts(recorded, seconds, mpi_seconds, comm)
    write_json(output_path(), {"sleep_s": SLEEP_S, "ranks": comm.all_gather_object(
        {**parts, "step_s": seconds, "mpi_s": mpi_seconds, "collectives": len(recorded[2])})})


if __name__ == "__main__":
    main()

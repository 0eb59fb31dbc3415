"""The node transport's shared memory and failures: 2+ ranks gather, reduce and all-reduce through it for 40
steps, growing its slots on the way; rank 1 ends as argv[2] says at step 10 (`normal`: it does not; `raise`:
an exception; `kill`: SIGKILL, in the middle of the collectives). The files of fsdp_mpi's in /dev/shm are listed
after every step, to show that a slot's file is gone by the time every rank has gone on; their names' prefix
(rank 0's process id) goes to the output path + ``.prefix``, so that a test finds this job's files among those
of jobs running beside it."""

import os
import signal
import sys

import torch
from common import output_path, write_json

from fsdp_mpi import Communicator, abort_job_on_uncaught_exception

if __name__ == "__main__":
    mode = sys.argv[2]
    comm = Communicator()
    abort_job_on_uncaught_exception(comm.mpi_comm)
    ours = f"fsdp_mpi-{comm.broadcast_object(os.getpid())}-"  # the files rank 0 makes (others' may be there)
    if comm.rank == 0:  # before any can fail: the test looks for what this job left, not another's
        with open(f"{output_path()}.prefix", "w") as f:
            f.write(ours)
    listed_while_running = []
    for step in range(40):
        numel = 2 ** (8 + step % 12)  # 256 to 512 Ki elements: the slots grow, chunks repeat
        shard = torch.full((numel,), float(comm.rank))
        full = torch.empty(numel * comm.world_size)
        comm.all_gather_into(full, shard)
        comm.reduce_scatter_sum(shard, full)
        comm.all_reduce_sum_(shard)
        comm.barrier()  # rank 0 unlinks a new file after the others have mapped it: list once it has gone on
        listed_while_running += [name for name in os.listdir("/dev/shm") if name.startswith(ours)]
        if step == 10 and comm.rank == 1 and mode == "raise":
            raise RuntimeError("rank 1 fails on purpose")
        if step == 10 and comm.rank == 1 and mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
    sum_of_ranks = comm.world_size * (comm.world_size - 1) / 2
    write_json(output_path(), {"routes": comm.routes, "listed_while_running": listed_while_running,
                               # rank r's shard reduces to N * r; all-reduced, to N * the sum of the ranks
                               "sums_right": bool(torch.all(shard == comm.world_size * sum_of_ranks))})

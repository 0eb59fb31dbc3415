"""The node transport's shared memory and failures: 2+ ranks gather, reduce and all-reduce through it for 40
steps, growing its slots on the way; rank 1 ends as argv[2] says (`normal`: it does not; `named`: neither, with
the shared memory made as a named file, the fallback where /proc refuses; `raise`: an exception at step 10;
`kill`: SIGKILL at step 10, in the middle of the collectives; `kill-in-growth`: SIGKILL while it opens the memory
of the slots' growth at step 3). The files of fsdp_mpi's in /dev/shm are listed after every step, to show that a
slot's file is gone by the time every rank has gone on; their names' prefix (rank 0's process id) goes to the
output path + ``.prefix``, so that a test finds this job's files among those of jobs running beside it. A normal
run also gives the memory back (``Communicator.close``) and checks that wrapping a model grows the slots at once
to its largest unit."""

import os
import signal
import sys

import torch
from common import output_path, write_json

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy, abort_job_on_uncaught_exception


def mappings_of_slots() -> int:
    """How many of this process's memory mappings are node-transport memory (made with memfd, or a file)."""
    with open("/proc/self/maps") as maps:
        return sum("fsdp_mpi-" in line for line in maps)


def die_when_opening_shared_memory() -> None:
    """Rank 1's next open of the node's shared memory (through /proc, or a named file) kills it."""
    open_file = os.open

    def open_or_die(path, *args, **kwargs):
        if str(path).startswith("/proc/") or "fsdp_mpi-" in str(path):
            os.kill(os.getpid(), signal.SIGKILL)
        return open_file(path, *args, **kwargs)
    os.open = open_or_die


class Layers(torch.nn.Module):
    """One unit of 100 small layers: its buffer (108,800 bytes) is far larger than any one tensor."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(100)))

    def forward(self, x):
        return self.layers(x)


def slots_after_wrapping() -> dict:
    """A fresh communicator's slots before and after wrapping `Layers`: grown at set-up to the unit's buffer
    (what a reduce-scatter writes), not only to the largest tensor that wrapping broadcasts."""
    comm = Communicator()
    comm.barrier()
    model = FullyShardedDataParallel(Layers(), comm=comm, auto_wrap_policy=ModuleWrapPolicy({Layers}))
    unit_bytes = max(h.padded_numel * 4 for m in model.modules() if isinstance(m, FullyShardedDataParallel)
                     for h in m.handles)
    return {"unit_bytes": unit_bytes, "capacity": comm.transport(torch.device("cpu")).slots.capacity}


if __name__ == "__main__":
    mode = sys.argv[2]
    if mode == "named":
        del os.memfd_create  # as on a system without it: the named file instead
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
        if step == 3 and comm.rank == 1 and mode == "kill-in-growth":
            die_when_opening_shared_memory()
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
    sums_right = bool(torch.all(shard == comm.world_size * sum_of_ranks))  # rank r's shard reduces to N * r, ...
    mapped_before_close = mappings_of_slots()
    comm.close()
    mapped_after_close = mappings_of_slots()
    comm.all_reduce_sum_(shard)  # a collective after close opens the memory again
    write_json(output_path(), {"routes": comm.routes, "listed_while_running": listed_while_running,
                               "sums_right": sums_right and bool(torch.all(shard == comm.world_size ** 2 * sum_of_ranks)),
                               "mapped": [mapped_before_close, mapped_after_close],
                               "wrapped": slots_after_wrapping()})

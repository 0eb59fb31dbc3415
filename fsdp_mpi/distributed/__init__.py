"""torch.distributed over fsdp_mpi: a process-group backend named ``"fsdp_mpi"``, so that torch's own FSDP2
(``fully_shard``), DDP, DTensor, device meshes and Lightning's strategies run on mpi4py and fsdp_mpi's transports.

    import fsdp_mpi.distributed                  # registers the backend
    fsdp_mpi.distributed.init_process_group()    # under mpiexec or srun: rank and world size from MPI

or ``torch.distributed.init_process_group("fsdp_mpi")`` where the usual variables are set. Read in this order:

    reductions      what each reduce op asks of fsdp_mpi's sums
    work            the handle torch gets: completed with the call's result or its error
    composed        torch's collectives made of the communicator's (lists, uneven parts, MAX and the like)
    process_group   each call torch makes, as a ``Communicator``'s collective or message
    groups          each group an MPI communicator of its own; the default group's start

What the backend supports and refuses, as torch's own tests of a backend found it: docs/adapters.md.
"""

import torch.distributed as dist

from fsdp_mpi.distributed.groups import create_group, init_process_group, never_split_from_ours
from fsdp_mpi.distributed.process_group import BACKEND, DEVICE_TYPES, MpiProcessGroup
from fsdp_mpi.distributed.reductions import Reduction

dist.Backend.register_backend(BACKEND, create_group, extended_api=True, devices=list(DEVICE_TYPES))
never_split_from_ours()

__all__ = ["BACKEND", "MpiProcessGroup", "Reduction", "init_process_group"]

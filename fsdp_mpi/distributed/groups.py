"""Making the backend's groups: the creator torch calls for each (``create_group``), and ``init_process_group``.

Every group is an MPI communicator of its own, made by its ranks alone: the default group and any group of all
ranks a duplicate of the world's, a smaller group MPI's group of its ranks. No two groups share a communicator, so
that two threads are never in collectives on one (a group's communication thread beside another's). The
limit on each of a group's calls is its ``timeout=`` (``process_group.MpiProcessGroup.over``).
"""

from datetime import timedelta

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from mpi4py import MPI

from fsdp_mpi.distributed.process_group import BACKEND, MpiProcessGroup


def create_group(options, backend_options=None) -> MpiProcessGroup:
    """torch's creator of a group (``register_backend(extended_api=True)``): the group of
    ``options.global_ranks_in_group`` (all ranks for the default group), collective over those ranks."""
    world = MPI.COMM_WORLD
    ranks = list(options.global_ranks_in_group) or list(range(world.Get_size()))
    if ranks == list(range(world.Get_size())):
        mpi_comm = world.Dup()
    else:
        group = world.Get_group().Incl(ranks)
        mpi_comm = world.Create_group(group, tag=_tag(ranks))
        group.Free()
    if mpi_comm.Get_rank() != options.group_rank or mpi_comm.Get_size() != options.group_size:
        raise RuntimeError(f"{BACKEND}: torch.distributed's rank {options.group_rank} of {options.group_size} is "
                           f"MPI's rank {mpi_comm.Get_rank()} of {mpi_comm.Get_size()}: start every rank under "
                           f"mpiexec or srun, with RANK and WORLD_SIZE (if set) as MPI numbers them")
    return MpiProcessGroup.over(mpi_comm, options.timeout.total_seconds(), options.store)


def _tag(ranks: list[int]) -> int:
    """A tag for MPI_Comm_create_group that differs between groups made at once by different ranks."""
    return sum(rank * 31 ** index for index, rank in enumerate(ranks)) % 32767


def init_process_group(timeout: timedelta | None = None, **kwargs) -> None:
    """``torch.distributed.init_process_group`` on this backend, with rank and world size from MPI (started by
    ``mpiexec`` or ``srun``): no ``MASTER_ADDR`` or store to give."""
    world = MPI.COMM_WORLD
    store = dist.HashStore()  # torch's default group needs a store; the collectives never use it
    dist.init_process_group(BACKEND, store=store, rank=world.Get_rank(), world_size=world.Get_size(),
                            **({"timeout": timeout} if timeout is not None else {}), **kwargs)


def never_split_from_ours() -> None:
    """Makes torch look for a communicator to split a new group from only among backends of its own.

    torch 2.14 hands a new group's creator the default group's backend on its bound device (``device_id=``, as
    Lightning binds it on a GPU) as the communicator to split from (``split_from``, typed as a C++ backend, for
    NCCL's ``ncclCommSplit``). Ours is a Python group, which those options refuse with a TypeError before our
    creator is even called, so ``new_group`` and every device mesh failed. A group of ours is made by its own
    ranks (``create_group``): it splits from nothing. Earlier torch asks the same function and takes None alike.
    Idempotent."""
    torch_split_source = c10d._get_split_source
    if getattr(torch_split_source, "never_ours", False):
        return

    def split_source(pg):
        source = torch_split_source(pg)
        return None if isinstance(source, MpiProcessGroup) else source
    split_source.never_ours = True
    c10d._get_split_source = split_source

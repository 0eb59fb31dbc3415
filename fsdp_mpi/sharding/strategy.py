"""How much of a unit's state each rank keeps between uses, and which ranks share a shard.

Every strategy is one layout of the ranks into *shard groups* (whose ranks split
the parameters: all-gather and reduce-scatter run within a group) and *replica
groups* (ranks holding the same shard in different shard groups: their reduced
gradients are averaged with one all-reduce). With 4 ranks as 2 nodes of 2::

    FULL_SHARD, SHARD_GRAD_OP: shard groups {0 1 2 3}          replicas: none
    HYBRID_SHARD:              shard groups {0 1} {2 3}        replica groups {0 2} {1 3}
    NO_SHARD:                  shard groups {0} {1} {2} {3}    replica group {0 1 2 3}
"""

from enum import Enum

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.settings import HYBRID_GROUP_SIZE, read_text



class ShardingStrategy(Enum):
    """Names follow torch FSDP so that users feel at home.

    FULL_SHARD: parameters, gradients and optimizer state are sharded over all
        ranks; a unit's full parameters exist only while it computes (ZeRO-3).
    SHARD_GRAD_OP: like FULL_SHARD, but a unit keeps its gathered parameters from
        its forward until its backward, trading memory for one all-gather less (ZeRO-2-like).
    HYBRID_SHARD: FULL_SHARD within each group of ranks (a node by default), every
        group a replica of the others: gathers never leave the group, and each
        reduced gradient shard is then averaged over the replicas (torch's HSDP).
    NO_SHARD: every rank keeps everything, gradients are all-reduced (DDP's layout).
    """

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"
    HYBRID_SHARD = "hybrid_shard"
    NO_SHARD = "no_shard"


class ShardGroups:
    """This rank's shard group and replica group under a strategy, built once per wrapped model.

    Args:
        comm: every rank of the model.
        strategy: the sharding strategy.
        hybrid_group_size: ranks per shard group under HYBRID_SHARD. Defaults to
            ``FSDP_MPI_HYBRID_GROUP_SIZE``, else the ranks of this rank's node
            (``MPI_Comm_split_type`` shared memory); set it to act as several nodes on one.
    """

    def __init__(self, comm: Communicator, strategy: ShardingStrategy, hybrid_group_size: int | None = None):
        if strategy is not ShardingStrategy.HYBRID_SHARD and hybrid_group_size is not None:
            raise ValueError("hybrid_group_size applies to ShardingStrategy.HYBRID_SHARD only")
        self.shard, self.replicas = comm, None
        if strategy is ShardingStrategy.NO_SHARD and comm.world_size > 1:  # one rank: FULL_SHARD's one group
            self.shard, self.replicas = comm.split(comm.rank), comm
        elif strategy is ShardingStrategy.HYBRID_SHARD:
            size = _hybrid_group_size(hybrid_group_size)
            if size is None:  # the node's ranks, wherever the launcher placed them
                self.shard = comm.split(None)
                sizes = comm.all_gather_object(self.shard.world_size)
                if len(set(sizes)) > 1:
                    raise ValueError(f"HYBRID_SHARD groups ranks by node, but the nodes run different numbers of "
                                     f"ranks ({sorted(set(sizes))}): run as many on each, or set "
                                     f"{HYBRID_GROUP_SIZE.name} or hybrid_group_size")
            elif comm.world_size % size:
                raise ValueError(f"HYBRID_SHARD groups of {size} ranks do not divide the {comm.world_size} ranks")
            else:  # consecutive ranks
                self.shard = comm.split(comm.rank // size) if size < comm.world_size else comm
            if self.shard.world_size < comm.world_size:  # the same position in every group: one replica group
                self.replicas = comm.split(self.shard.rank)


def _hybrid_group_size(requested: int | None) -> int | None:
    """hybrid_group_size, else FSDP_MPI_HYBRID_GROUP_SIZE, else None (group by node)."""
    if requested is None:
        text = read_text(HYBRID_GROUP_SIZE)
        if not text:
            return None
        if not text.isdigit() or int(text) < 1:
            raise ValueError(f"{HYBRID_GROUP_SIZE.name}={text!r}: expected a positive number of ranks per group")
        return int(text)
    if not isinstance(requested, int) or requested < 1:
        raise ValueError(f"hybrid_group_size={requested!r}: expected a positive number of ranks per group")
    return requested

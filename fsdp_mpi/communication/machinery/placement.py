"""Where a communicator's ranks are: which share a node, and whether a collective can go in two levels.

The node of a rank is what MPI says shares its memory (``MPI_COMM_TYPE_SHARED``),
or, with ``FSDP_MPI_EMULATED_NODE_SIZE=K`` (tests and benchmarks only), its block
of K consecutive ranks of the job, so that one machine can act as several nodes (whose
memory is still shared: the node transport works inside each).

Two levels need every node to run the same number k of the communicator's n·k
ranks, placed in one of the two ways launchers place them: in blocks (node i
holds ranks i·k .. i·k + k − 1, SLURM's and mpiexec's default) or round robin
(node i holds ranks i, i + n, i + 2n, ...). Then the rows of a full buffer that
one local index j gathers across nodes are a view of it, and the shards keep the
meaning they have in one flat ring: rank r holds elements [r·S, (r + 1)·S).
"""

from dataclasses import dataclass

import torch
from mpi4py import MPI

from fsdp_mpi.communication.failures.job import job_rank
from fsdp_mpi.communication.settings import EMULATED_NODE_SIZE, read_count


def split_by_node(mpi_comm):
    """A communicator of the ranks of `mpi_comm` on this rank's node (real or emulated), in rank order."""
    emulated = read_count(EMULATED_NODE_SIZE)
    if emulated is not None:  # by the job's ranks: a communicator of some of them sees the same nodes
        return mpi_comm.Split(job_rank() // emulated, mpi_comm.Get_rank())
    return mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, mpi_comm.Get_rank())


@dataclass(frozen=True)
class Layout:
    """n nodes of k ranks each; this rank is local rank `local` of node `node`; `blocks`: node i holds ranks
    i·k .. i·k + k − 1, else round robin (node i holds ranks i, i + n, ...)."""

    nodes: int
    per_node: int
    node: int
    local: int
    blocks: bool

    def rank(self, node: int, local: int) -> int:
        return node * self.per_node + local if self.blocks else local * self.nodes + node

    def by_local_rank(self, rows: torch.Tensor) -> torch.Tensor:
        """rows (W, ...) in rank order, as the view (k, n, ...): [j, i] is the row of local rank j of node i."""
        if self.blocks:
            return rows.view(self.nodes, self.per_node, *rows.shape[1:]).transpose(0, 1)
        return rows.view(self.per_node, self.nodes, *rows.shape[1:])


def two_level_layout(mpi_comm, node_comm) -> tuple[Layout | None, str]:
    """The layout of `mpi_comm` over its nodes (`node_comm`: this rank's), if it can go in two levels; else None
    and why not. Collective over `mpi_comm`."""
    rank, world = mpi_comm.Get_rank(), mpi_comm.Get_size()
    # Each rank's node is named by its node's lowest rank; nodes are numbered in the order of those.
    leaders = mpi_comm.allgather(min(node_comm.allgather(rank)))
    nodes = sorted(set(leaders))
    sizes = [leaders.count(leader) for leader in nodes]
    if len(set(sizes)) > 1:
        return None, f"its nodes run different numbers of its ranks ({', '.join(map(str, sizes))})"
    per_node, count = sizes[0], len(nodes)
    if per_node == 1:
        return None, "one of its ranks on each node: nothing to do inside a node"
    node_of = [nodes.index(leader) for leader in leaders]
    local_of = [sum(1 for earlier in range(r) if node_of[earlier] == node_of[r]) for r in range(world)]
    for blocks in (True, False):
        layout = Layout(count, per_node, node_of[rank], local_of[rank], blocks)
        if all(layout.rank(node_of[r], local_of[r]) == r for r in range(world)):
            return layout, f"{count} nodes of {per_node} ranks, {'in blocks' if blocks else 'round robin'}"
    return None, "its ranks are placed on the nodes neither in blocks nor round robin"

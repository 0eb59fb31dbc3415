"""A group that spans nodes, in two levels: inside each node through the node's transport, across nodes through
MPI among the ranks with the same local index (as NCCL, Open MPI's han and ZeRO++'s hierarchical partitioning do).

n nodes of k ranks, a unit of S elements per rank (``placement.Layout``: rows of a
full buffer by local rank are a view of it)::

    all-gather      across: the k rank-j's gather their shards (n of S each, (n − 1)/n · n·S moved per rank)
                    inside: the node's k ranks gather those n-row blocks into their rows of the full buffer
    reduce-scatter  inside: each rank receives the node's sum of the n rows bound for its local index's ranks
                    (in fp32 for 16-bit values, not rounded)
                    across: an all-to-all sends row i to node i; each rank adds the n rows it receives in node
                    order, rounding once
    all-reduce      the reduce-scatter above on chunks of ceil(N / W), then the all-gather of the sums
    broadcast       across, among the root's local index, from the root's node; then inside every node
    all-to-all      inside: each rank gathers from the node's ranks the rows bound for its local index's ranks;
                    across: an all-to-all sends each node its k rows

So a node sends (n − 1)/n of a unit's bytes per direction and collective in k
streams of 1/k each, where one flat ring over n·k ranks sends (n·k − 1)/(n·k) of
them from every rank, and n + k − 2 steps instead of n·k − 1. A reduce-scatter
is summed in a fixed order, node by node of each node's sum in rank order, so it
gives the same bits run after run; across nodes it moves fp32 for 16-bit values,
as MPI's sums do. The inside level is the node transport, or MPI (``blocks_over``)
where that is off; the level across is MPI, direct or staged.
"""

from typing import Callable

import torch

from fsdp_mpi.communication.machinery.placement import Layout, two_level_layout
from fsdp_mpi.communication.machinery.sums import sum_in_rank_order, summed_in_fp32
from fsdp_mpi.communication.settings import TWO_LEVEL
from fsdp_mpi.communication.transports.node import NodeTransport
from fsdp_mpi.communication.transports.transport import Offer, Transport

ThroughMpi = Callable[..., Offer]  # (an MPI communicator made for a level) -> MPI's transport over it, and its line


class BlocksOverMpi:
    """The node level's block collectives (``node.NodeTransport``'s) on a transport of whole buffers, MPI's:
    the blocks are copied into one contiguous buffer and out of it."""

    def __init__(self, flat: Transport, ranks: int):
        self.flat, self.world = flat, ranks

    def all_gather_blocks(self, out: torch.Tensor, mine: torch.Tensor) -> None:
        gathered = torch.empty((self.world, *mine.shape), dtype=mine.dtype, device=mine.device)
        self.flat.all_gather(gathered.view(-1), mine.contiguous().view(-1))
        out.copy_(gathered)

    def reduce_scatter_blocks(self, out: torch.Tensor, parts: torch.Tensor) -> None:
        mine = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        self.flat.reduce_scatter(mine.view(-1), parts.to(out.dtype).contiguous().view(-1))  # fp32 in, unrounded
        out.copy_(mine)

    def all_to_all_blocks(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        gathered = torch.empty(sent.shape, dtype=sent.dtype, device=sent.device)
        self.flat.all_to_all(gathered.view(-1), sent.contiguous().view(-1))
        received.copy_(gathered)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        self.flat.broadcast(flat, root)

    def runs_started_on_the_worker(self, tensor: torch.Tensor) -> bool:
        return self.flat.runs_started_on_the_worker(tensor)

    def reserve(self, nbytes: int) -> None:
        pass

    def close(self) -> None:
        self.flat.close()


class TwoLevel(Transport):
    """Args:
        layout: the nodes and this rank's place among them.
        inside: the node level over this rank's node (``NodeTransport``, or ``BlocksOverMpi``).
        across: MPI (``Direct`` or ``Staged``) over the ranks of this rank's local index, one per node, in node order.
    """

    route = "two-level"

    @classmethod
    def offer(cls, comm, node_comm, device: torch.device, through_mpi: ThroughMpi) -> Offer:
        """Itself over `comm`'s ranks, which span several nodes (`node_comm`: this rank's), unless they are
        placed so that no level fits or `comm`'s settings turn it off; inside each node the node transport where
        it accepts, else MPI; across nodes MPI (`through_mpi` makes its levels). Collective over `comm`."""
        layout, how = two_level_layout(comm.mpi_comm, node_comm)
        spanning = f"the ranks span several nodes ({node_comm.Get_size()} of {comm.world_size} on this one)"
        if layout is None or not comm.two_level:
            return Offer(None, f"{spanning}, one flat ring: {f'{TWO_LEVEL.name}=0' if layout is not None else how}")
        across = through_mpi(comm.mpi_comm.Split(layout.local, comm.rank))
        inside = NodeTransport.offer(comm, node_comm, device)
        inside_line = f"through {inside.line}"
        if inside.transport is None:
            inside_line = (f"through MPI ({inside.line})" if not comm.node_transport
                           else f"through MPI (the node's memory could not be shared: {inside.line})")
            inside = Offer(BlocksOverMpi(through_mpi(node_comm).transport, node_comm.Get_size()), "")
        return Offer(cls(layout, inside.transport, across.transport), (
            f"{spanning}: in two levels, {how}: inside each node {inside_line}, across nodes "
            f"{across.line.split(';')[0]} ({TWO_LEVEL.name}=0: one flat ring instead)"))

    def __init__(self, layout: Layout, inside, across: Transport):
        self.layout, self.inside, self.across = layout, inside, across

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        n = self.layout.nodes
        mine = torch.empty(n, shard.numel(), dtype=shard.dtype, device=shard.device)  # my local index's, by node
        self.across.all_gather(mine.view(-1), shard)
        self.inside.all_gather_blocks(self.layout.by_local_rank(full.view(-1, shard.numel())), mine)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        n = self.layout.nodes
        wide = torch.float32 if summed_in_fp32(shard.dtype) else shard.dtype
        node_sums = torch.empty(n, shard.numel(), dtype=wide, device=shard.device)  # row i: for node i's rank
        self.inside.reduce_scatter_blocks(node_sums, self.layout.by_local_rank(full.view(-1, shard.numel())))
        from_nodes = torch.empty_like(node_sums)  # row i: node i's sum of my row
        self.across.all_to_all(from_nodes.view(-1), node_sums.view(-1))
        sum_in_rank_order(list(from_nodes), shard)

    def all_reduce(self, flat: torch.Tensor) -> None:
        ranks = self.layout.nodes * self.layout.per_node
        chunk = -(-flat.numel() // ranks)
        padded = torch.zeros(ranks * chunk, dtype=flat.dtype, device=flat.device)
        padded[:flat.numel()] = flat
        summed = torch.empty(chunk, dtype=flat.dtype, device=flat.device)
        self.reduce_scatter(summed, padded)
        self.all_gather(padded, summed)  # every rank takes the same rounded sums: replicas stay identical
        flat.copy_(padded[:flat.numel()])

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        layout = self.layout
        root_node, root_local = next((node, local) for node in range(layout.nodes) for local in range(layout.per_node)
                                     if layout.rank(node, local) == root)
        if layout.local == root_local:
            self.across.broadcast(flat, root_node)
        self.inside.broadcast(flat, root_local)

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        layout, width = self.layout, sent.numel() // (self.layout.nodes * self.layout.per_node)
        # Inside: from each local rank j, its rows bound for my local index's ranks, node by node: (k, n, c).
        bound_here = torch.empty(layout.per_node, layout.nodes, width, dtype=sent.dtype, device=sent.device)
        self.inside.all_to_all_blocks(bound_here, layout.by_local_rank(sent.view(-1, width)))
        # Across: node i gets the k rows bound for its rank of my local index; from node i, its k ranks' rows.
        from_nodes = torch.empty(layout.nodes, layout.per_node, width, dtype=sent.dtype, device=sent.device)
        self.across.all_to_all(from_nodes.view(-1), bound_here.transpose(0, 1).contiguous().view(-1))
        layout.by_local_rank(received.view(-1, width)).copy_(from_nodes.transpose(0, 1))

    def runs_started_on_the_worker(self, tensor: torch.Tensor) -> bool:
        return self.inside.runs_started_on_the_worker(tensor) or self.across.runs_started_on_the_worker(tensor)

    @property
    def staging_slots(self) -> list[str]:
        inside = self.inside.flat if isinstance(self.inside, BlocksOverMpi) else self.inside
        return inside.staging_slots + self.across.staging_slots

    def reserve(self, nbytes: int) -> None:
        self.inside.reserve(nbytes)  # the node level's reduce-scatter takes the whole buffer

    def close(self) -> None:
        self.inside.close()
        self.across.close()

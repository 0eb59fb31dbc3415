"""A group of one rank: no MPI call at all. Gathering is a copy (or nothing, when the buffers are one), reducing
leaves the values as they are. So one rank is plain torch plus the wrapper's bookkeeping, on the GPU with
nothing staged and nothing synchronised."""

import torch

from fsdp_mpi.communication.transports.transport import Offer, Transport


class OneRank(Transport):
    route = "one rank"
    makes_mpi_calls = False

    @classmethod
    def offer(cls, comm) -> Offer:
        """Itself for a group of one rank, whatever its memory: the one place that tells one rank apart."""
        if comm.world_size != 1:
            return Offer(None, f"{comm.world_size} ranks")
        return Offer(cls(), "one rank: no tensor reaches MPI (gathering is a copy or nothing, reducing leaves "
                            "gradients as they are)")

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        _copy_unless_same(full, shard)

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        _copy_unless_same(shard, full)

    def all_reduce(self, flat: torch.Tensor) -> None:
        pass

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        _copy_unless_same(received, sent)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        pass


def _copy_unless_same(target: torch.Tensor, source: torch.Tensor) -> None:
    if target.data_ptr() != source.data_ptr():
        target.copy_(source)

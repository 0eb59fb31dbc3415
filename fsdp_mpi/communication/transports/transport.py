"""``Transport``: the one interface behind which every way of moving a collective's bytes sits.

A ``Communicator`` asks its routes (``routes.py``) for a transport per kind of
memory, once, and from then on calls it; it never asks which kind it has. Each
way is one subclass that owns its own cutting into pieces (``machinery/chunks.py``), its
sums (``machinery/sums.py``: 16-bit values in fp32, parts in rank order) and how a started
collective runs:

    one_rank.py    a group of one rank: no MPI call, gathering is a copy or nothing
    direct.py      MPI reads the tensors where they are (host memory; device memory if CUDA-aware)
    staged.py      through pinned host buffers, chunk by chunk (device memory MPI cannot read)
    node.py        through memory the ranks of one node share; MPI only says when
    two_level.py   a group that spans nodes: inside each node (one of the above), then across nodes

Each says itself whether it can carry a communicator's collectives on a kind of
memory, and why not (``offer``, as vLLM's custom all-reduce disables itself with
a reason); ``routes.py`` asks them in order, keeps the first that accepts, and
makes the line that says why from their answers.

Buffers reach a transport checked (1-D, contiguous, sizes matching) and already
logged and watched by the communicator, which also keeps the ranks' collectives
in order with its communication thread.
"""

from dataclasses import dataclass

import torch

from fsdp_mpi.communication.machinery.sums import summed_in_fp32


@dataclass(frozen=True)
class Offer:
    """A transport's answer to "can you carry these ranks' collectives on this memory?": the transport and what
    it moves through, or None and why not."""

    transport: "Transport | None"
    line: str


class Transport:
    """How one kind of memory travels among one communicator's ranks. Every method is collective."""

    route = ""  # its name in the routes' lines and in ``Communicator.routes``
    makes_mpi_calls = True  # False: one rank, whose collectives are neither logged nor counted

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        """full (W * S,) <- every rank's shard (S,), in rank order."""
        raise NotImplementedError

    def reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        """shard (S,) <- the sum over ranks of their full[rank * S:(rank + 1) * S]."""
        raise NotImplementedError

    def all_reduce(self, flat: torch.Tensor) -> None:
        """flat (N,) <- its element-wise sum over ranks, in place."""
        raise NotImplementedError

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        """received (W * K,) <- chunk `rank` of every rank's sent (W * K,), in rank order: bits, no arithmetic."""
        raise NotImplementedError

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        """flat (N,) <- root's."""
        raise NotImplementedError

    def runs_started_on_the_worker(self, tensor: torch.Tensor) -> bool:
        """Whether a started collective on `tensor` runs on the communication thread (host work that would hold
        the main thread: staging, queueing device copies behind barriers, waiting for a stream before MPI)."""
        return False

    def nonblocking_all_gather(self, full: torch.Tensor, shard: torch.Tensor):
        """Where this transport starts an all-gather of these buffers as MPI's nonblocking call: what starts it
        (and returns its request); else None (a started all-gather then runs to its end when started, or on the
        communication thread)."""
        return None

    def nonblocking_reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor):
        """As ``nonblocking_all_gather``, for a reduce-scatter."""
        return None

    def widened_for_sum(self, shard: torch.Tensor, full: torch.Tensor):
        """(shard, full, finish) to reduce-scatter instead: where MPI sums 16-bit values, fp32 copies made here,
        on the caller's thread and stream, and `finish` rounding the sum back into `shard`; else the buffers as
        they are and None."""
        return shard, full, None

    def summed_bytes(self, tensor: torch.Tensor) -> int:
        """Bytes of `tensor` a sum puts on the wire: as they are, or widened to fp32 where MPI sums."""
        return tensor.numel() * tensor.element_size()

    @property
    def staging_slots(self) -> list[str]:
        """The host staging buffers it has used (none unless it stages)."""
        return []

    def reserve(self, nbytes: int) -> None:
        """Makes ready now (collective) what a collective whose full buffer has `nbytes` needs (node memory), so
        that it is not grown in the middle of a step, near its peak of memory."""

    def close(self) -> None:
        """Gives back what the transport holds (collective)."""


class WidenedForMpi:
    """What the transports whose sums MPI computes share: 16-bit values reach MPI as fp32 copies
    (``machinery/sums.py``), and a communicator made for them (a level of ``two_level``) is freed with them."""

    owned_comm = None  # an MPI communicator this transport was made with, freed by ``close``

    def close(self) -> None:
        if self.owned_comm is not None:
            self.owned_comm.Free()
            self.owned_comm = None

    def widened_for_sum(self, shard: torch.Tensor, full: torch.Tensor):
        if not summed_in_fp32(shard.dtype):
            return shard, full, None
        shard_fp32 = torch.empty(shard.numel(), dtype=torch.float32, device=shard.device)
        return shard_fp32, full.float(), lambda: shard.copy_(shard_fp32)

    def summed_bytes(self, tensor: torch.Tensor) -> int:
        return tensor.numel() * (4 if summed_in_fp32(tensor.dtype) else tensor.element_size())

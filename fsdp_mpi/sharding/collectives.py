"""How a handle's data travels: the gather of its shards and the reduction of its gradient, chosen once.

A ``FlatParamHandle`` asks for a gather and a reduction when it is built and from
then on only calls them; it never asks how the bytes go. Three kinds of each:

    shard group of one rank   gather: a cast copy (or nothing, when the gathered buffer aliases the shard);
                              reduce-scatter: the gradient is its own shard
    compressed                weights or gradients encoded by a ``compression.py`` codec on the wire
    plain                     ``comm.py``'s all-gather, reduce-scatter and all-reduce, sums as MPI computes them

A reduction also averages over the replicas (HYBRID_SHARD, NO_SHARD), in its own
kind (compressed or plain); a shard group of one rank still has replicas to
average over. Every collective here is a sum: the handle scales the gradient
(in backward, or by dividing the sum), never the collective.

A started gather or reduction is an ``InFlight`` (``communication/machinery/in_flight.py``), whatever runs it:
``wait()`` completes it and returns its result (a reduction's shard of the gradient).
"""

import torch

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.compression import (Codec, compressed_all_gather, compressed_all_reduce_sum_,
                                                 compressed_reduce_scatter_sum, start_compressed_all_gather)
from fsdp_mpi.communication.machinery.in_flight import InFlight
from fsdp_mpi.sharding.offload import on_device


# ----------------------------------------------------------------- gathers: full (W * S,) <- every rank's shard (S,)


class LocalGather:
    """A shard group of one rank: gathering is a cast into the compute dtype (or nothing, when aliased)."""

    communicates = False  # the gathered buffer may be the shard itself (FlatParamHandle.aliases_shard)

    def into(self, full: torch.Tensor, shard: torch.Tensor, unit: str) -> None:
        full.copy_(shard)

    def start_into(self, full: torch.Tensor, shard: torch.Tensor, unit: str) -> InFlight:
        self.into(full, shard, unit)
        return InFlight()


class PlainGather:
    """The shard cast to the compute dtype and moved to the compute device (`full`'s: where it is offloaded,
    ``offload.on_device``), then all-gathered."""

    communicates = True

    def __init__(self, comm: Communicator):
        self.comm = comm

    def into(self, full: torch.Tensor, shard: torch.Tensor, unit: str) -> None:
        self.comm.all_gather_into(full, on_device(shard, full.device, full.dtype), unit)

    def start_into(self, full: torch.Tensor, shard: torch.Tensor, unit: str) -> InFlight:
        return self.comm.start_all_gather_into(full, on_device(shard, full.device, full.dtype), unit)


class CompressedGather:
    """The fp32 shard encoded by `codec`, gathered, and decoded into the compute dtype (when waited for)."""

    communicates = True

    def __init__(self, comm: Communicator, codec: Codec):
        self.comm, self.codec = comm, codec

    def into(self, full: torch.Tensor, shard: torch.Tensor, unit: str) -> None:
        compressed_all_gather(self.comm, full, on_device(shard, full.device, shard.dtype), self.codec, unit)

    def start_into(self, full: torch.Tensor, shard: torch.Tensor, unit: str) -> InFlight:
        return start_compressed_all_gather(self.comm, full, on_device(shard, full.device, shard.dtype), self.codec,
                                           unit)


def choose_gather(comm: Communicator, codec: Codec | None) -> LocalGather | PlainGather | CompressedGather:
    """The gather of a handle whose shard group is `comm`, with weights encoded by `codec` (None: plain)."""
    if comm.world_size == 1:
        return LocalGather()
    return PlainGather(comm) if codec is None else CompressedGather(comm, codec)


# ----------------------------------------------------------------- reductions: sums over the shard group, then replicas


class PlainReduction:
    """Reduce-scatter over the shard group and all-reduce over the replicas, in the gradient's dtype."""

    communicates = True
    gradient_is_its_own_shard = False  # a new (shard_numel,) tensor: the full gradient's memory can go back

    def __init__(self, comm: Communicator, replicas: Communicator | None):
        self.comm, self.replicas = comm, replicas

    def reduce_scatter(self, full_grad: torch.Tensor, unit: str) -> torch.Tensor:
        """(shard_numel,): this rank's chunk of the sum of every rank's (padded_numel,) `full_grad`."""
        shard_grad = _empty_shard(full_grad, self.comm)
        self.comm.reduce_scatter_sum(shard_grad, full_grad.contiguous(), unit)
        return shard_grad

    def start_reduce_scatter(self, full_grad: torch.Tensor, unit: str) -> InFlight:
        shard_grad = _empty_shard(full_grad, self.comm)
        return self.comm.start_reduce_scatter_sum(shard_grad, full_grad.contiguous(), unit).then(None, shard_grad)

    def all_reduce_over_replicas(self, shard_grad: torch.Tensor, unit: str) -> None:
        if self.replicas is not None:
            self.replicas.all_reduce_sum_(shard_grad, unit)


class CompressedReduction:
    """An all-to-all of encoded gradient chunks, summed here in fp32 in rank order; it completes when started."""

    communicates = True
    gradient_is_its_own_shard = False

    def __init__(self, comm: Communicator, replicas: Communicator | None, codec: Codec):
        self.comm, self.replicas, self.codec = comm, replicas, codec

    def reduce_scatter(self, full_grad: torch.Tensor, unit: str) -> torch.Tensor:
        shard_grad = _empty_shard(full_grad, self.comm)
        compressed_reduce_scatter_sum(self.comm, shard_grad, full_grad.contiguous(), self.codec, unit)
        return shard_grad

    def start_reduce_scatter(self, full_grad: torch.Tensor, unit: str) -> InFlight:
        return InFlight(self.reduce_scatter(full_grad, unit))

    def all_reduce_over_replicas(self, shard_grad: torch.Tensor, unit: str) -> None:
        if self.replicas is not None:
            compressed_all_reduce_sum_(self.replicas, shard_grad, self.codec, unit)


class LocalReduction:
    """A shard group of one rank: the gradient is its own shard; `over_replicas` averages it over the replicas."""

    gradient_is_its_own_shard = True  # the full gradient's memory stays: it is the shard's gradient

    def __init__(self, over_replicas: PlainReduction | CompressedReduction):
        self.over_replicas = over_replicas
        self.communicates = over_replicas.replicas is not None

    def reduce_scatter(self, full_grad: torch.Tensor, unit: str) -> torch.Tensor:
        return full_grad

    def start_reduce_scatter(self, full_grad: torch.Tensor, unit: str) -> InFlight:
        return InFlight(full_grad)

    def all_reduce_over_replicas(self, shard_grad: torch.Tensor, unit: str) -> None:
        self.over_replicas.all_reduce_over_replicas(shard_grad, unit)


def _empty_shard(full_grad: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """(shard_numel,) uninitialised, of `full_grad`'s dtype and device: a rank's chunk of a (padded_numel,) gradient."""
    return full_grad.new_empty(full_grad.numel() // comm.world_size)


Reduction = PlainReduction | CompressedReduction | LocalReduction


def choose_reduction(comm: Communicator, replicas: Communicator | None, codec: Codec | None) -> Reduction:
    """The reduction of a handle whose shard group is `comm` and replica group `replicas` (None: none), with
    gradients encoded by `codec` (None: plain)."""
    reduction = PlainReduction(comm, replicas) if codec is None else CompressedReduction(comm, replicas, codec)
    return LocalReduction(reduction) if comm.world_size == 1 else reduction

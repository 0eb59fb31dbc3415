"""torch's collectives made of the ``Communicator``'s: what each call of ``MpiProcessGroup`` runs.

A reduce op that MPI's sum cannot do (MAX, MIN, PRODUCT, the bitwise ones: ``reductions.py``) brings every
rank's values together (an all-gather, or an all-to-all for a reduce-scatter) and combines them here; lists of
tensors and parts of uneven sizes travel through one flat buffer, as bytes where their dtypes differ.
"""

import functools
import math

import torch
import torch.distributed as dist

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.distributed.reductions import Reduction


def all_reduce(comm: Communicator, tensor: torch.Tensor, op: Reduction) -> None:
    """tensor <- its reduction over the ranks, in place, as `op` says."""
    flat = _contiguous(tensor)
    if op.combined:
        gathered = torch.empty(comm.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
        comm.all_gather_into(gathered, flat.view(-1))
        flat.copy_(op.combine(gathered.view(comm.world_size, *flat.shape)))
    else:
        factor = op.scale_before(flat.dtype, comm.world_size)
        if factor is not None:
            flat.mul_(factor)
        comm.all_reduce_sum_(flat)
        op.after(flat, comm.world_size)
    if flat is not tensor:
        tensor.copy_(flat)

def sparse_sum(comm: Communicator, tensor: torch.Tensor, op: Reduction) -> None:
    """A sparse tensor's sum over ranks, in place: every rank's entries (pickled: they differ in number),
    added here."""
    if op.kind != dist.ReduceOp.SUM:
        raise NotImplementedError(f"fsdp_mpi: all_reduce of a sparse tensor with {op.kind}: SUM only")
    mine = tensor.coalesce()
    entries = comm.all_gather_object((mine.indices().cpu(), mine.values().cpu()))
    total = functools.reduce(torch.add, [torch.sparse_coo_tensor(indices, values, tensor.shape)
                                         for indices, values in entries])
    tensor.copy_(total.coalesce().to(tensor.device))

def reduce_scatter(comm: Communicator, shard: torch.Tensor, rows: torch.Tensor, op: Reduction) -> None:
    """shard (S,) <- the reduction over ranks of their rows[rank] ((ranks, S) rows)."""
    if op.combined:  # every rank's row for this rank, then combined here
        mine = torch.empty_like(rows)
        comm.all_to_all(mine.view(-1), rows.contiguous().view(-1))
        shard.copy_(op.combine(mine))
        return
    factor = op.scale_before(rows.dtype, comm.world_size)
    full = rows * factor if factor is not None else rows.contiguous()  # a copy: the caller's input stays
    comm.reduce_scatter_sum(shard, full.view(-1))
    op.after(shard, comm.world_size)

def all_to_all(comm: Communicator, output: torch.Tensor, input: torch.Tensor) -> None:
    """output <- rank j's j-th even part of its input for this rank, in rank order."""
    received = _contiguous(output)
    comm.all_to_all(received.view(-1), _contiguous(input).view(-1))
    if received is not output:
        output.copy_(received)

def broadcast(comm: Communicator, tensor: torch.Tensor, root: int) -> None:
    """tensor <- `root`'s, in place."""
    flat = _contiguous(tensor)
    comm.broadcast_(flat, root)
    if flat is not tensor:
        tensor.copy_(flat)

def all_to_all_parts(comm: Communicator, received: list, sent: list) -> None:
    """received[j] <- rank j's sent[this rank], parts of any sizes: each padded to the largest part of any rank
    (one small reduction finds it), moved in one even all-to-all, and cut back on arrival."""
    world, sizes = comm.world_size, [part.numel() for part in sent + received]
    widest = int(comm.all_reduce_max_float(max(sizes, default=0)))
    reference = sent[0] if sent else received[0]
    padded = torch.zeros(world, widest, dtype=reference.dtype, device=reference.device)
    for j, part in enumerate(sent):
        padded[j, :part.numel()] = part.reshape(-1)
    arrived = torch.empty_like(padded)
    all_to_all(comm, arrived.view(-1), padded.view(-1))
    for j, part in enumerate(received):
        part.copy_(arrived[j, :part.numel()].view_as(part))


def gathered_bytes(comm: Communicator, inputs) -> list[torch.Tensor]:
    """Every rank's `inputs` in one all-gather of their bytes: per input, its (ranks, bytes) view."""
    sent = torch.cat([_bytes_of(tensor) for tensor in inputs]) if inputs else torch.empty(0, dtype=torch.uint8)
    full = torch.empty(comm.world_size * sent.numel(), dtype=torch.uint8, device=sent.device)
    comm.all_gather_into(full, sent)
    rows = full.view(comm.world_size, sent.numel())
    return list(rows.split([tensor.numel() * tensor.element_size() for tensor in inputs], dim=1))


def parts(tensor: torch.Tensor, split_sizes, ranks: int) -> list[torch.Tensor]:
    """`tensor`'s parts along dim 0, as `split_sizes` say (none: `ranks` even parts), each flat."""
    rows = split_sizes or [tensor.shape[0] // ranks] * ranks
    return list(tensor.reshape(-1).split([n * math.prod(tensor.shape[1:]) for n in rows]))


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`'s bytes, flat (a view where it is contiguous)."""
    return _contiguous(tensor).view(-1).view(torch.uint8)


def write_bytes(tensor: torch.Tensor, data: torch.Tensor) -> None:
    """tensor <- `data` ((ranks, width) or (width,) bytes, in order), whatever its dtype."""
    tensor.copy_(data.reshape(-1).view(tensor.dtype).view_as(tensor))

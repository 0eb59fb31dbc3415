"""How values are summed, in one place: 16-bit floats in fp32, rounded once; several ranks' parts in rank order.

MPI has no 16-bit float sum, and a sum kept in 16 bits would round at every
addition: 16-bit values are summed in fp32 wherever fsdp_mpi sums (the transports
that add the ranks' parts themselves, and MPI's own sums through fp32 copies).
Adding the parts in rank order makes every rank compute the same bits, so
all-reduced replicas stay identical, and a run repeat itself whatever order the
messages arrived in.
"""

from collections.abc import Sequence

import torch

SUM_IN_FP32 = (torch.float16, torch.bfloat16)


def summed_in_fp32(dtype: torch.dtype) -> bool:
    return dtype in SUM_IN_FP32


def sum_in_rank_order(parts: Sequence[torch.Tensor], out: torch.Tensor) -> None:
    """out <- parts[0] + parts[1] + ..., left to right, in fp32 for 16-bit values (rounded once at the end).

    `out` may be one of the parts' memory; a part on another device is copied over first.
    """
    parts = [part if part.device == out.device else part.to(out.device, non_blocking=True) for part in parts]
    if len(parts) == 2 and not summed_in_fp32(out.dtype) and parts[0].dtype == parts[1].dtype == out.dtype:
        torch.add(parts[0], parts[1], out=out)  # element by element: out may alias either part
        return
    total = parts[0].to(torch.float32 if summed_in_fp32(out.dtype) else out.dtype, copy=True)
    for part in parts[1:]:
        total.add_(part)
    out.copy_(total)

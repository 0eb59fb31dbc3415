"""What a torch reduce op asks of fsdp_mpi's sums: ``Reduction``.

The transports sum (in fp32 for 16-bit floats, rounded once; bool as a logical or); torch's ops become:

    SUM          the sum, in the tensor's dtype (integers wrap, as NCCL's and gloo's do)
    AVG          the sum over the ranks' count. Floats are divided after the sum, except 16-bit ones, whose
                 values each rank divides first (as NCCL does): their sum could pass the type's range on the way
                 to an average inside it. Integers are divided after, truncated as C divides.
    PREMUL_SUM   each rank's values times a factor, then summed (floats)
    MAX, MIN, PRODUCT, BAND, BOR, BXOR
                 combined from every rank's values (``combine``), which the caller first brings together
"""

import functools

import torch
import torch.distributed as dist

from fsdp_mpi.communication.machinery.sums import summed_in_fp32

_OP = dist.ReduceOp.RedOpType
_COMBINED = {  # (ranks, ...) -> (...): every rank's values in rank order, combined
    _OP.MAX: lambda by_rank: by_rank.amax(0),
    _OP.MIN: lambda by_rank: by_rank.amin(0),
    _OP.PRODUCT: lambda by_rank: by_rank.prod(0).to(by_rank.dtype),
    _OP.BAND: lambda by_rank: functools.reduce(torch.bitwise_and, by_rank),
    _OP.BOR: lambda by_rank: functools.reduce(torch.bitwise_or, by_rank),
    _OP.BXOR: lambda by_rank: functools.reduce(torch.bitwise_xor, by_rank),
}


class Reduction:
    """A reduce op as the collectives apply it: a sum with a factor before it (``before``) and a division after
    it (``after``), or a combination of every rank's values (``combined``, ``combine``)."""

    def __init__(self, kind, factor: float | None = None):
        self.kind, self.factor = kind, factor

    @classmethod
    def of(cls, opts, call: str, dtype: torch.dtype) -> "Reduction":
        """The reduction `opts` names (SUM without opts) for `call` on `dtype`; ValueError naming the call for an op
        the dtype has no meaning for, NotImplementedError for one torch has but fsdp_mpi does not."""
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        kind = getattr(op, "op", op)  # a ReduceOp object carries its RedOpType
        floating = dtype.is_floating_point or dtype.is_complex
        if kind in (_OP.AVG, _OP.PREMUL_SUM) and dtype == torch.bool:
            raise ValueError(f"fsdp_mpi: {call} with {kind.name} of bool tensors: only SUM (a logical or), MAX, "
                             f"MIN, PRODUCT and the bitwise ops")
        if kind == _OP.PREMUL_SUM:
            if not floating:
                raise ValueError(f"fsdp_mpi: {call} with PREMUL_SUM of {dtype} tensors: floats only")
            return cls(kind, float(op.factor))
        if kind in (_OP.BAND, _OP.BOR, _OP.BXOR) and floating:
            raise ValueError(f"fsdp_mpi: {call} with {kind.name} of {dtype} tensors: integers and bool only")
        if dtype.is_complex and kind in (_OP.MAX, _OP.MIN):
            raise ValueError(f"fsdp_mpi: {call} with {kind.name} of complex tensors, which have no order")
        if kind in (_OP.SUM, _OP.AVG) or kind in _COMBINED:
            return cls(kind)
        raise NotImplementedError(f"fsdp_mpi: {call} with {kind}: SUM, AVG, PREMUL_SUM, MAX, MIN, PRODUCT, BAND, "
                                  f"BOR and BXOR are supported")

    @property
    def combined(self) -> bool:
        return self.kind in _COMBINED

    def combine(self, by_rank: torch.Tensor) -> torch.Tensor:
        """(ranks, ...) -> (...): every rank's values, in rank order, combined."""
        return _COMBINED[self.kind](by_rank)

    def scale_before(self, dtype: torch.dtype, ranks: int) -> float | None:
        """What each rank multiplies its values by before the sum, or None."""
        if self.kind == _OP.AVG and summed_in_fp32(dtype):
            return 1.0 / ranks
        return self.factor

    def after(self, tensor: torch.Tensor, ranks: int) -> None:
        """Completes the reduction in place on the summed `tensor`."""
        if self.kind != _OP.AVG or summed_in_fp32(tensor.dtype):
            return
        if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
            tensor.div_(ranks)
        else:
            tensor.copy_(torch.div(tensor, ranks, rounding_mode="trunc"))

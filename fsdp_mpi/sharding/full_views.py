"""A handle's full-shape views of its gathered buffer, and how their gradients become one flat gradient.

A unit computes with views of ``full_flat`` (``flat_param.py``), one per parameter,
made once per handle and kept. Each forward that autograd records binds them to
a new ``FullViews`` node; its backward writes their gradients into one flat
gradient, already scaled, in one concatenation.
"""

import torch

from fsdp_mpi.communication.timing_points import GRADIENT_ASSEMBLY, timed
from fsdp_mpi.sharding.host_memory import BorrowedBuffer


class FullViews(torch.autograd.Function):
    """Makes a forward's autograd node for a handle's kept full-shape views of its gathered (padded_numel,)
    buffer: the views are given back as they are, now the outputs of this new node; backward writes their
    gradients, times `scale`, into one flat gradient (zeros for a view that got none, and for the padding)
    in memory borrowed from `buffer` (None: new memory), and marks in `received` (one flag per view) the
    views that got one.

    Its backward concatenates as ``torch.split``'s would, into one new flat gradient,
    with zeros where a view got none, and scales it: in host memory in the same pass, on a GPU after. ``ctx`` keeps shapes, the
    padding, the flags and where the flat gradient goes, no reference to the handle
    (the handle holds the views, whose node this is: a cycle through autograd that no collector breaks).

    Why a new node every forward, for the same views: autograd's engine runs, of the
    nodes that are ready, the most recently created first. A node made once, in the
    first step, would be older than every node of later steps, so it would wait
    until the end of each backward, and with it every unit's post-backward hook:
    all units would stay gathered, their gradients unreduced, through the whole
    backward (issue #58: a peak 1.1 GiB higher on a 355M model). Binding the kept
    views to a new node costs ~6 µs a unit; making new views ~45 µs.
    """

    @staticmethod
    def forward(ctx, full: torch.Tensor, views: tuple[torch.Tensor, ...], scale: float,
                received: list[bool], buffer: BorrowedBuffer | None) -> tuple[torch.Tensor, ...]:
        # `views` is a tuple, not tensor arguments: autograd takes them as this node's outputs, not its inputs.
        ctx.set_materialize_grads(False)
        ctx.shapes, ctx.scale, ctx.like = [view.shape for view in views], scale, (full.numel(), full.dtype,
                                                                                    full.device)
        ctx.padding = full.numel() - sum(view.numel() for view in views)
        ctx.received, ctx.buffer = received, buffer
        return views

    @staticmethod
    @torch.autograd.function.once_differentiable
    @timed(GRADIENT_ASSEMBLY)
    def backward(ctx, *grads: torch.Tensor | None):
        padded_numel, dtype, device = ctx.like
        for index, grad in enumerate(grads):
            ctx.received[index] = ctx.received[index] or grad is not None
        into = (torch.empty(padded_numel, dtype=dtype, device=device) if ctx.buffer is None
                else ctx.buffer.take(padded_numel, dtype))
        if device.type == "cpu":  # bound by memory: one pass, each gradient scaled as it is copied in
            parts = into.split([*(shape.numel() for shape in ctx.shapes), ctx.padding])
            for part, grad in zip(parts, (*grads, None)):
                if grad is None:
                    part.zero_()
                else:
                    torch.mul(grad.reshape(-1), ctx.scale, out=part)
            return into, None, None, None, None
        # One concatenation, not a copy per parameter: on a GPU, a kernel or two per unit instead of one per
        # parameter, which a step of many small units would wait for the host to launch.
        pieces = [grad.reshape(-1) if grad is not None else torch.zeros(shape.numel(), dtype=dtype, device=device)
                  for shape, grad in zip(ctx.shapes, grads)]
        if ctx.padding:  # none on one rank
            pieces.append(torch.zeros(ctx.padding, dtype=dtype, device=device))
        full_grad = torch.cat(pieces, out=into)
        return (full_grad if ctx.scale == 1.0 else full_grad.mul_(ctx.scale)), None, None, None, None

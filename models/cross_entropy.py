"""Cross-entropy taken in fp32 over 16-bit logits, on a GPU a slab of rows at a time, never all of them in fp32.

Under mixed precision the output layer's logits come out in bf16 or fp16, and
the loss must still be taken in fp32. ``F.cross_entropy(logits.float(), ...)``
does that with three full-size fp32 tensors: the copy, log-softmax's output
(kept for backward) and, in backward, the gradient. For GPT-2 with 16 × 1024
tokens over 50,304 words each is 3.3 GB, twice the logits' own size.
``slab_cross_entropy`` takes each slab's log-softmax in fp32 straight from the
16-bit logits and keeps nothing of it but the rows' losses; backward takes the
slab's softmax again the same way and writes the gradient straight in the
logits' dtype. Beyond the logits and their gradient, one slab in fp32 (at most
``SLAB_BYTES``) is all the memory it takes, and it moves about half the bytes,
which is what sets a GPU's pace here.

On a CPU the pace is set by the exponentials instead, and the softmax taken
again costs more than torch's backward, which reuses the log-softmax it kept: on
bf16 logits of 512 × 50,304 the slabs took 1.26× torch's time on one core
(fp32: the same). So ``cross_entropy``, which every model and experiment calls,
takes torch's loss on a CPU and slabs elsewhere: the one place that choice is made.

The mean is over the rows whose target is not ``ignore_index``, as in
``F.cross_entropy``: no such row gives nan there and here.
"""

import torch
import torch.nn.functional as F

SLAB_BYTES = 256 * 2**20  # fp32 bytes of logits taken at once: big enough that slabs are few kernel launches


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                  reduction: str = "mean") -> torch.Tensor:
    """Cross-entropy of `logits` (N, V) against class indices `targets` (N,), in fp32 (float64 stays so): each row's
    (N,) with reduction "none" (0 where ignored), or their mean over the rows not ignored."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"logits must be (N, V) and targets (N,), got {tuple(logits.shape)} and "
                         f"{tuple(targets.shape)}")
    if reduction not in ("mean", "none"):
        raise ValueError(f'reduction must be "mean" or "none", got {reduction!r}')
    if logits.device.type == "cpu":
        fp32_or_wider = torch.promote_types(logits.dtype, torch.float32)
        return F.cross_entropy(logits.to(fp32_or_wider), targets, ignore_index=ignore_index, reduction=reduction)
    return slab_cross_entropy(logits, targets, ignore_index, reduction)


def slab_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100,
                       reduction: str = "mean") -> torch.Tensor:
    """``cross_entropy`` by slabs on any device, with no fp32 tensor of all the logits (see above)."""
    row_losses = _SlabCrossEntropy.apply(logits, targets, ignore_index)  # (N,)
    if reduction == "none":
        return row_losses
    return row_losses.sum() / (targets != ignore_index).sum()


def _slabs(rows: int, vocab: int) -> list[slice]:
    """Row ranges of at most SLAB_BYTES of fp32 logits each."""
    step = max(1, SLAB_BYTES // (4 * vocab))
    return [slice(start, start + step) for start in range(0, rows, step)]


class _SlabCrossEntropy(torch.autograd.Function):
    """Each row's loss, minus the log-softmax at its target; 0 for rows whose target is ignored. Backward computes
    each slab's softmax again from the logits (one fused pass) rather than keep anything of it."""

    @staticmethod
    def forward(ctx, logits, targets, ignore_index):
        ctx.fp32_or_wider = torch.promote_types(logits.dtype, torch.float32)  # a float64 reference stays float64
        counted = targets != ignore_index  # (N,)
        classes = torch.where(counted, targets, 0)[:, None]  # (N, 1): an ignored row looks at class 0, then counts 0
        row_losses = torch.empty(logits.shape[0], dtype=ctx.fp32_or_wider, device=logits.device)  # (N,)
        for rows in _slabs(*logits.shape):
            log_softmax = torch.log_softmax(logits[rows], dim=1, dtype=ctx.fp32_or_wider)  # (rows, V)
            row_losses[rows] = -log_softmax.gather(1, classes[rows]).squeeze(1)
        ctx.save_for_backward(logits, classes, counted)
        return torch.where(counted, row_losses, 0.0)

    @staticmethod
    def backward(ctx, grad_rows):  # (N,): d output / d each row's loss
        logits, classes, counted = ctx.saved_tensors
        weight = torch.where(counted, grad_rows, 0.0)[:, None]  # (N, 1)
        grad = torch.empty_like(logits)
        for rows in _slabs(*logits.shape):
            softmax = torch.softmax(logits[rows], dim=1, dtype=ctx.fp32_or_wider)  # (rows, V)
            softmax.scatter_add_(1, classes[rows], torch.full_like(classes[rows], -1, dtype=softmax.dtype))
            torch.mul(softmax, weight[rows], out=grad[rows])  # rounded once, to the logits' dtype
        return grad, None, None

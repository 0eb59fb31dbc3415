"""The models' fp32 cross-entropy over 16-bit logits (models/cross_entropy.py): the slabs give torch's loss and
gradient with no fp32 tensor of all the logits made in forward or backward; a CPU takes torch's own.

On the CPU here; tests/test_gpu.py runs this file again with FSDP_MPI_TEST_DEVICE=cuda, in a process of its own.
"""

import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from fsdp_mpi_models import cross_entropy as slab_module
from fsdp_mpi_models.cross_entropy import cross_entropy, slab_cross_entropy

DEVICE = torch.device(os.environ.get("FSDP_MPI_TEST_DEVICE", "cpu"))
ROWS, VOCAB, PADDED = 50, 61, 64  # 3 padding columns, at -inf as the models' output layer makes them
UNIT_ROUNDOFF = 2.0 ** -24  # fp32
BF16_SPACING = 2.0 ** -7  # bf16's gap between neighbours, relative to the value (8 significant bits)


def logits_and_targets(dtype):
    generator = torch.Generator().manual_seed(0)
    logits = 4 * torch.randn(ROWS, PADDED, generator=generator)
    logits[:, VOCAB:] = float("-inf")
    targets = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    targets[::7] = -100  # ignored rows
    return logits.to(DEVICE, dtype).requires_grad_(), targets.to(DEVICE)


@pytest.fixture
def slabs_of_8_rows(monkeypatch):
    """Slabs of 8 rows: 50 rows make 6 whole slabs and a part."""
    monkeypatch.setattr(slab_module, "SLAB_BYTES", 8 * 4 * PADDED)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_and_gradient_are_torchs_on_the_fp32_logits(dtype, reduction, slabs_of_8_rows):
    logits, targets = logits_and_targets(dtype)
    weights = torch.rand(ROWS, generator=torch.Generator().manual_seed(1)).to(DEVICE)  # a gradient per row
    ours = slab_cross_entropy(logits, targets, reduction=reduction)
    ((ours * weights).sum() if reduction == "none" else ours).backward()
    our_grad, logits.grad = logits.grad, None
    reference = F.cross_entropy(logits.float(), targets, reduction=reduction)
    ((reference * weights).sum() if reduction == "none" else reference).backward()

    assert ours.dtype == torch.float32 and our_grad.dtype == dtype
    # Both take each row's log-sum-exp over PADDED terms, then (mean) sum ROWS of them, in other orders: each
    # sum's roundoff is at most its terms' count in units of roundoff, relative to the largest magnitude.
    scale = float(logits.detach().float()[:, :VOCAB].abs().max())
    torch.testing.assert_close(ours, reference, rtol=0, atol=(PADDED + ROWS) * scale * UNIT_ROUNDOFF)
    # A gradient is softmax minus one-hot times the row's weight (≤ 1): the softmax's normalising sum, up to
    # PADDED units of roundoff, and exp of values up to 2 scale apart move each probability by as much
    # relatively. In bf16 both are then rounded once from fp32 values that close: at most one bf16 spacing apart.
    fp32_bound = (PADDED + 2 * scale) * UNIT_ROUNDOFF
    rounding = BF16_SPACING if dtype == torch.bfloat16 else 0.0
    torch.testing.assert_close(our_grad.float(), logits.grad.float(), rtol=rounding, atol=fp32_bound)
    ignored = targets == -100
    assert torch.all(our_grad[ignored] == 0) and torch.all(our_grad[:, VOCAB:] == 0)


class LargestFloat32(TorchDispatchMode):
    """Records the most elements any fp32 tensor made by an operation had."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in (out if isinstance(out, (tuple, list)) else [out]):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32:
                self.most = max(self.most, tensor.numel())
        return out


def test_no_fp32_tensor_of_all_the_logits_is_made_or_kept(slabs_of_8_rows):
    """The largest fp32 tensor is one slab, in forward and in backward, and only the logits are kept."""
    logits, targets = logits_and_targets(torch.bfloat16)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        with LargestFloat32() as forward:
            loss = slab_cross_entropy(logits, targets)
    with LargestFloat32() as backward:
        loss.backward()
    assert forward.most == backward.most == 8 * PADDED, (forward.most, backward.most)  # one slab in fp32
    kept_floats = [t for t in saved if t.is_floating_point()]
    assert len(kept_floats) == 1 and kept_floats[0].data_ptr() == logits.data_ptr()  # the logits, nothing in fp32
    with LargestFloat32() as torchs:  # what the measure sees in torch's loss over an fp32 copy
        F.cross_entropy(logits.float(), targets).backward()
    assert torchs.most == ROWS * PADDED


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cpu_takes_torchs_loss_on_an_fp32_copy_and_a_gpu_slabs(dtype):
    logits, targets = logits_and_targets(dtype)
    ours = cross_entropy(logits, targets, reduction="none")
    ours.sum().backward()
    our_grad, logits.grad = logits.grad, None
    expected = (F.cross_entropy(logits.float(), targets, reduction="none") if DEVICE.type == "cpu"
                else slab_cross_entropy(logits, targets, reduction="none"))
    expected.sum().backward()
    assert torch.equal(ours, expected) and torch.equal(our_grad, logits.grad)


def test_bad_shapes_and_reductions_are_refused():
    logits, targets = logits_and_targets(torch.float32)
    with pytest.raises(ValueError, match=r"logits must be \(N, V\) and targets \(N,\)"):
        cross_entropy(logits[None], targets)
    with pytest.raises(ValueError, match=r"logits must be \(N, V\) and targets \(N,\)"):
        cross_entropy(logits, targets[:-1])
    with pytest.raises(ValueError, match='reduction must be "mean" or "none"'):
        cross_entropy(logits, targets, reduction="sum")

"""The vocabulary padded to a multiple of 64 rows, with the padding kept out of every output and checkpoint.

A GPU multiplies matrices in tiles: GPT-2's 50,257 words make the output layer's
product ragged, and padding them to 50,304 made nanoGPT's step about a quarter
faster. So the word embedding (and the output layer tied to it) holds
``padded_size(vocab_size, multiple)`` rows in memory. The padding rows start at
zero, no input id reaches them, and the output layer adds -inf to their logits
(as the bias of its own matrix product, so no extra pass over the logits):
softmax gives them probability 0 exactly, so no loss, sample or gradient ever
sees them, and they stay zero through training. Models return logits sliced to
the real vocabulary (a view, no copy), and read and write checkpoints in Hugging
Face's shapes: a checkpoint holds only the first ``vocab_size`` rows.
"""

import torch
import torch.nn.functional as F
from torch import nn

MULTIPLE = 64  # rows; the tile that tensor cores and most BLAS kernels divide evenly


def padded_size(vocab_size: int, multiple: int) -> int:
    """`vocab_size` rounded up to a multiple of `multiple` (1: no padding)."""
    if vocab_size < 1 or multiple < 1:
        raise ValueError(f"vocab_size ({vocab_size}) and vocab_multiple ({multiple}) must be positive")
    return -(-vocab_size // multiple) * multiple


class VocabularyOutput(nn.Linear):
    """The projection onto a padded vocabulary: an ``nn.Linear`` with ``out_features`` the padded size, whose
    logits past ``vocab_size`` come out -inf (the padding's mask added as part of the bias)."""

    def __init__(self, in_features: int, vocab_size: int, padded: int, bias: bool):
        super().__init__(in_features, padded, bias=bias)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., padded)
        padding = self.out_features - self.vocab_size
        if not padding:
            return super().forward(x)
        mask = torch.zeros(self.out_features, dtype=self.weight.dtype, device=self.weight.device)
        mask[self.vocab_size:] = float("-inf")
        return F.linear(x, self.weight, mask if self.bias is None else self.bias + mask)


def zero_padding(weight: torch.Tensor, vocab_size: int) -> None:
    """Zeroes the padding rows of a freshly initialised vocabulary tensor (in place, no gradient)."""
    with torch.no_grad():
        weight[vocab_size:].zero_()

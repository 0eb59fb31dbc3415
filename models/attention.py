"""Scaled dot-product attention with its dropout as a module, shared by GPT-2 and BERT.

torch's fused kernel draws attention dropout inside itself. A plain ``nn.Dropout`` is handed to it (its p);
any other dropout module (fsdp_mpi's ``SampleDropout``, whose masks follow the sample) gets the attention
probabilities, computed here as the unfused kernel does: softmax(q k^T / sqrt(d) + mask) @ v.
"""

import torch
import torch.nn.functional as F
from torch import nn


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: nn.Dropout, *, causal: bool = False,
              attend: torch.Tensor | None = None) -> torch.Tensor:
    """(B, nh, T, hs) q, k, v -> (B, nh, T, hs); `attend`: bool, broadcastable to (B, nh, T, T), True where a
    query may look; `causal`: each position looks only at itself and before."""
    p = dropout.p if dropout.training else 0.0
    if p == 0 or type(dropout) is nn.Dropout:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attend, is_causal=causal, dropout_p=p)
    scores = q @ k.transpose(-2, -1) * q.shape[-1] ** -0.5  # (B, nh, T, T)
    if causal:
        later = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(later, float("-inf"))
    if attend is not None:
        scores = scores.masked_fill(~attend, float("-inf"))
    probabilities = scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))  # 16 bits: in 32
    return dropout(probabilities.to(v.dtype)) @ v

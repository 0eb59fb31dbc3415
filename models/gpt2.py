"""GPT-2, laid out like Hugging Face's ``GPT2LMHeadModel`` so published checkpoints load unchanged.

A ladder of small classes, bottom-up: Conv1D, CausalSelfAttention, MLP, GPT2Block,
GPT2Model, GPT2LMHeadModel. ``GPT2Block`` is the unit to name in
``fsdp_mpi.ModuleWrapPolicy``. The output head shares its weight with the token
embedding (weight tying), as in the published model.
"""

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True)
class GPT2Config:
    vocab_size: int = 50257
    n_positions: int = 1024  # context length
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    dropout: float = 0.1  # embedding, attention and residual dropout alike
    layer_norm_epsilon: float = 1e-5
    gradient_checkpointing: bool = False  # recompute each block's activations in backward


GPT2_CONFIGS = {
    "gpt2-tiny": GPT2Config(vocab_size=128, n_positions=64, n_embd=64, n_layer=2, n_head=2, dropout=0.0),
    "gpt2-seed": GPT2Config(n_positions=256, n_embd=384, n_layer=6, n_head=6, dropout=0.2),
    "gpt2": GPT2Config(),
    "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": GPT2Config(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": GPT2Config(n_embd=1600, n_layer=48, n_head=25),
}


def gpt2_config(name: str, **overrides) -> GPT2Config:
    """A named configuration, with fields overridden (e.g. ``vocab_size=65`` for characters)."""
    if name not in GPT2_CONFIGS:
        raise ValueError(f"unknown GPT-2 config {name!r}; choose one of {', '.join(GPT2_CONFIGS)}")
    return replace(GPT2_CONFIGS[name], **overrides)


class Conv1D(nn.Module):
    """A linear layer whose weight is stored (in_features, out_features), as OpenAI's GPT-2 stores it."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.c_attn = Conv1D(config.n_embd, 3 * config.n_embd)  # query, key, value together
        self.c_proj = Conv1D(config.n_embd, config.n_embd)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, embd = x.shape
        q, k, v = self.c_attn(x).split(embd, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, embd // self.n_head).transpose(1, 2) for t in (q, k, v))
        # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(batch, seq, embd)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = Conv1D(config.n_embd, 4 * config.n_embd)
        self.c_proj = Conv1D(4 * config.n_embd, config.n_embd)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class GPT2Block(nn.Module):
    """One pre-LayerNorm transformer layer: the natural sharding unit."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.gradient_checkpointing = config.gradient_checkpointing
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._layer, x, use_reentrant=False)
        return self._layer(x)

    def _layer(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):
    """Embeddings, the stack of blocks and the final LayerNorm (HF's ``transformer``)."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(nn.Module):
    """GPT-2 with its language-modelling head, tied to the token embedding."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        self.transformer = GPT2Model(config)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.transformer.wte.weight
        self.apply(self._init_weights)
        # GPT-2 scales the residual projections by 1/sqrt(2 * n_layer).
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding, Conv1D)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, (nn.Linear, Conv1D)) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None):
        """Returns (logits (B, T, vocab), mean cross-entropy against `targets` (B, T) or None)."""
        if input_ids.shape[1] > self.config.n_positions:
            raise ValueError(f"sequence of {input_ids.shape[1]} tokens exceeds context {self.config.n_positions}")
        logits = self.lm_head(self.transformer(input_ids))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss

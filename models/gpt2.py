"""GPT-2, laid out like Hugging Face's ``GPT2LMHeadModel`` so published checkpoints load unchanged.

A ladder of small classes, bottom-up: Conv1D, CausalSelfAttention, MLP, GPT2Block,
GPT2Model, GPT2LMHeadModel. ``GPT2Block`` is the unit to name in
``fsdp_mpi.ModuleWrapPolicy``. The output head shares its weight with the token
embedding (weight tying), as in the published model. Both hold the vocabulary
padded to a multiple of ``vocab_multiple`` rows (50,257 -> 50,304), which no
output, loss or checkpoint shows (``models/vocabulary.py``). Loading and saving
published checkpoints, counts and FLOPs are ``PretrainedModel``'s (``models/pretrained_model.py``).
"""

import math
import re
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import attention
from .cross_entropy import cross_entropy
from .initialization import embedding, finish_construction
from .pretrained_model import PretrainedModel
from .vocabulary import MULTIPLE, VocabularyOutput, padded_size, zero_padding


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
    vocab_multiple: int = MULTIPLE  # the embedding and output layer hold vocab_size rounded up to this (1: unpadded)

    @property
    def padded_vocab_size(self) -> int:
        return padded_size(self.vocab_size, self.vocab_multiple)


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


_SHARED_HF_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_epsilon")


def config_from_hf(hf: dict) -> GPT2Config:
    """Our config from a Hugging Face GPT-2 ``config.json``."""
    values = {name: hf[name] for name in _SHARED_HF_FIELDS if name in hf}
    return GPT2Config(**values, dropout=hf.get("resid_pdrop", GPT2Config.dropout))


def config_to_hf(config: GPT2Config) -> dict:
    """A Hugging Face GPT-2 ``config.json`` for our config, so that transformers loads our checkpoints."""
    hf = {name: getattr(config, name) for name in _SHARED_HF_FIELDS}
    return {
        "model_type": "gpt2",
        "architectures": ["GPT2LMHeadModel"],
        **hf,
        "n_inner": None,
        "activation_function": "gelu_new",
        "resid_pdrop": config.dropout,
        "embd_pdrop": config.dropout,
        "attn_pdrop": config.dropout,
        "tie_word_embeddings": True,
    }


def config_from_tensors(tensors: dict) -> GPT2Config:
    """Infers a config from checkpoint shapes when there is no config.json (heads of 64 dims, as in GPT-2)."""
    def find(suffix):
        return next(t for k, t in tensors.items() if k.endswith(suffix))

    vocab_size, n_embd = find("wte.weight").shape
    layers = {match.group(1) for k in tensors if (match := re.match(r"(?:transformer\.)?h\.(\d+)\.", k))}
    return GPT2Config(vocab_size=vocab_size, n_positions=find("wpe.weight").shape[0], n_embd=n_embd,
                      n_layer=len(layers), n_head=max(n_embd // 64, 1))


def checkpoint_key_to_name(key: str) -> str | None:
    """Maps a published checkpoint's key to ours; None for the causal-mask buffers older files carry."""
    if key.endswith((".attn.bias", ".attn.masked_bias")):
        return None
    if not key.startswith(("transformer.", "lm_head.")):
        key = "transformer." + key  # checkpoints saved from GPT2Model lack the prefix
    return key


class Conv1D(nn.Module):
    """A linear layer whose weight is stored (in_features, out_features), as OpenAI's GPT-2 stores it."""

    is_residual_projection = False  # GPT-2 initialises the projections back into the residual stream smaller

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(*x.shape[:-1], -1)

    def to_linear(self) -> nn.Linear:
        """The same map as an ``nn.Linear`` (weight transposed to (out, in)), e.g. for tools that quantize Linear layers."""
        in_features, out_features = self.weight.shape
        linear = nn.Linear(in_features, out_features, device=self.weight.device, dtype=self.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(self.weight.t())
            linear.bias.copy_(self.bias)
        return linear


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        if config.n_embd % config.n_head:
            raise ValueError(f"n_embd ({config.n_embd}) must be divisible by n_head ({config.n_head})")
        self.n_head = config.n_head
        self.c_attn = Conv1D(config.n_embd, 3 * config.n_embd)  # query, key, value together
        self.c_proj = Conv1D(config.n_embd, config.n_embd)
        self.c_proj.is_residual_projection = True
        self.attn_dropout = nn.Dropout(config.dropout)  # on the attention probabilities
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, embd = x.shape
        q, k, v = self.c_attn(x).split(embd, dim=2)
        q, k, v = (t.view(batch, seq, self.n_head, embd // self.n_head).transpose(1, 2) for t in (q, k, v))
        # (B, nh, T, hs)
        y = attention(q, k, v, self.attn_dropout, causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, embd)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPT2Config):
        super().__init__()
        self.c_fc = Conv1D(config.n_embd, 4 * config.n_embd)
        self.c_proj = Conv1D(4 * config.n_embd, config.n_embd)
        self.c_proj.is_residual_projection = True
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
        self.wte = embedding(config.padded_vocab_size, config.n_embd)
        self.wpe = embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(GPT2Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.wte(input_ids) + self.wpe(positions))  # (B, T, C)
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class GPT2LMHeadModel(PretrainedModel):
    """GPT-2 with its language-modelling head, tied to the token embedding.

    Built under ``torch.device("meta")`` it stays there, for fsdp_mpi's deferred
    initialisation with ``param_init_fn=model.init_module`` (see ``models/initialization.py``).
    """

    # How GPT-2 meets Hugging Face's checkpoints (see PretrainedModel).
    checkpoint_key_to_name = staticmethod(checkpoint_key_to_name)
    _config_from_hf = staticmethod(config_from_hf)
    _config_from_tensors = staticmethod(config_from_tensors)
    _vocabulary_tensors = ("transformer.wte.weight", "lm_head.weight")
    _position_embeddings = "transformer.wpe.weight"

    def __init__(self, config: GPT2Config):
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.transformer = GPT2Model(config)
            self.lm_head = VocabularyOutput(config.n_embd, config.vocab_size, config.padded_vocab_size, bias=False)
        finish_construction(self, self._tie_weights)

    def _tie_weights(self) -> None:
        self.lm_head.weight = self.transformer.wte.weight

    def init_module(self, module: nn.Module) -> None:
        """Initialises `module`'s own parameters (not its submodules') as GPT-2 does.

        Weights normal(0, 0.02), the residual projections' scaled by 1/sqrt(2 n_layer);
        biases zero; LayerNorm weight one; the vocabulary's padding rows zero.
        """
        if isinstance(module, (nn.Linear, nn.Embedding, Conv1D)):
            residual = getattr(module, "is_residual_projection", False)
            std = 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02
            nn.init.normal_(module.weight, mean=0.0, std=std)
        if module in (self.transformer.wte, self.lm_head):  # one weight, initialised as each
            zero_padding(module.weight, self.config.vocab_size)
        if isinstance(module, (nn.Linear, Conv1D)) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)

    def _hf_config(self) -> dict:
        return config_to_hf(self.config)

    def _layers_and_width(self) -> tuple[int, int]:
        return self.config.n_layer, self.config.n_embd

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        return generate(self, input_ids, max_new_tokens, temperature, top_k, generator)

    def forward(self, input_ids: torch.Tensor, targets: torch.Tensor | None = None):
        """Returns (logits (B, T, vocab), mean cross-entropy against `targets` (B, T) or None).

        The logits are a view of the padded vocabulary's (B, T, padded) without the padding; the loss is
        taken over all of them, where the padding's are -inf and so count for nothing.
        """
        if input_ids.shape[1] > self.config.n_positions:
            raise ValueError(f"sequence of {input_ids.shape[1]} tokens exceeds context {self.config.n_positions}")
        padded_logits = self.lm_head(self.transformer(input_ids))  # (B, T, padded)
        loss = None
        if targets is not None:  # fp32 under mixed precision, with no fp32 copy of the logits
            loss = cross_entropy(padded_logits.view(-1, padded_logits.shape[-1]), targets.reshape(-1))
        return padded_logits[..., :self.config.vocab_size], loss


@torch.no_grad()
def generate(model: nn.Module, input_ids: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
             top_k: int | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """Samples `max_new_tokens` tokens after `input_ids` (B, T); returns (B, T + max_new_tokens).

    `model` is a GPT2LMHeadModel or a wrapper around one (fsdp_mpi's FullyShardedDataParallel):
    calling the wrapper lets it gather weights. Under mpiexec every rank must call this with
    the same arguments; seed `generator` alike on every rank to draw the same tokens.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be positive, got {temperature}")
    context = getattr(model, "module", model).config.n_positions
    was_training = model.training
    model.eval()
    for _ in range(max_new_tokens):
        logits, _ = model(input_ids[:, -context:])
        logits = logits[:, -1, :] / temperature  # (B, vocab)
        if top_k is not None:
            kth_largest = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, [-1]]
            logits = logits.masked_fill(logits < kth_largest, float("-inf"))
        next_token = torch.multinomial(torch.softmax(logits.float(), dim=-1), num_samples=1, generator=generator)
        input_ids = torch.cat([input_ids, next_token], dim=1)
    model.train(was_training)
    return input_ids

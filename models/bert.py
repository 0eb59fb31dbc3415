"""BERT, laid out like Hugging Face's ``BertForPreTraining`` so published checkpoints load unchanged.

Bottom-up: embeddings, self-attention, the feed-forward part, ``BertLayer`` (the
unit to name in ``fsdp_mpi.ModuleWrapPolicy``), the encoder, and two heads:
pre-training (masked-LM and next-sentence prediction) and sequence classification.
The masked-LM decoder shares its weight with the word embedding. Both hold the
vocabulary padded to a multiple of ``vocab_multiple`` rows (30,522 -> 30,528),
which no output, loss or checkpoint shows (``models/vocabulary.py``). The sizes are
a ``BertConfig`` (``models/bert_configuration.py``); loading and saving published
checkpoints, counts and FLOPs are ``PretrainedModel``'s (``models/pretrained_model.py``).
"""

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .attention import attention
from .bert_configuration import BertConfig, config_from_hf, config_from_tensors, config_to_hf
from .cross_entropy import cross_entropy
from .initialization import embedding, finish_construction
from .pretrained_model import PretrainedModel
from .vocabulary import VocabularyOutput, zero_padding

IGNORE_INDEX = -100  # masked-LM labels of positions that are not predicted


BERT_CONFIGS = {
    "bert-tiny": BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    # The size the original study trained from scratch, 46.7M parameters with the pre-training heads
    # (the study gives the count, not the shape): 4 layers of width 704, 11 heads of 64.
    "bert-seed": BertConfig(hidden_size=704, num_hidden_layers=4, num_attention_heads=11, intermediate_size=2816),
    "bert-base": BertConfig(),
    "bert-large": BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def bert_config(name: str, **overrides) -> BertConfig:
    """A named configuration, with fields overridden."""
    if name not in BERT_CONFIGS:
        raise ValueError(f"unknown BERT config {name!r}; choose one of {', '.join(BERT_CONFIGS)}")
    return replace(BERT_CONFIGS[name], **overrides)


def checkpoint_key_to_name(key: str) -> str | None:
    """Maps a published checkpoint's key to ours; None for the index buffers older files carry."""
    key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
    if key.endswith(("position_ids", "token_type_ids")):
        return None
    if not key.startswith(("bert.", "cls.", "classifier.")):
        key = "bert." + key  # checkpoints saved from BertModel lack the prefix
    return key


def classifier_checkpoint_key_to_name(key: str) -> str | None:
    """As ``checkpoint_key_to_name``, with the pre-training heads skipped: they are not part of a classifier."""
    return None if key.startswith("cls.") else checkpoint_key_to_name(key)


class BertEmbeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = embedding(config.padded_vocab_size, config.hidden_size)
        self.position_embeddings = embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions) + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))  # (B, T, H)


class BertSelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        if config.hidden_size % config.num_attention_heads:
            raise ValueError(
                f"hidden_size ({config.hidden_size}) must be divisible by num_attention_heads ({config.num_attention_heads})"
            )
        self.num_heads = config.num_attention_heads
        self.dropout = nn.Dropout(config.attention_probs_dropout_prob)  # on the attention probabilities
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, attend: torch.Tensor | None) -> torch.Tensor:
        batch, seq, hidden = x.shape
        q, k, v = (
            layer(x).view(batch, seq, self.num_heads, hidden // self.num_heads).transpose(1, 2)
            for layer in (self.query, self.key, self.value)
        )  # (B, nh, T, hs)
        y = attention(q, k, v, self.dropout, attend=attend)
        return y.transpose(1, 2).reshape(batch, seq, hidden)


class BertSelfOutput(nn.Module):
    """Projection, dropout, residual and LayerNorm after attention (post-LayerNorm, as in BERT)."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dropout(self.dense(hidden)) + residual)


class BertAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = BertSelfAttention(config)
        self.output = BertSelfOutput(config)

    def forward(self, x: torch.Tensor, attend: torch.Tensor | None) -> torch.Tensor:
        return self.output(self.self(x, attend), x)


class BertIntermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(self.dense(x))


class BertOutput(BertSelfOutput):
    """Feed-forward down-projection, dropout, residual and LayerNorm."""

    def __init__(self, config: BertConfig):
        super().__init__(config)
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)


class BertLayer(nn.Module):
    """One transformer encoder layer: the natural sharding unit."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.gradient_checkpointing = config.gradient_checkpointing
        self.attention = BertAttention(config)
        self.intermediate = BertIntermediate(config)
        self.output = BertOutput(config)

    def forward(self, x: torch.Tensor, attend: torch.Tensor | None) -> torch.Tensor:
        if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
            return checkpoint(self._layer, x, attend, use_reentrant=False)
        return self._layer(x, attend)

    def _layer(self, x: torch.Tensor, attend: torch.Tensor | None) -> torch.Tensor:
        attended = self.attention(x, attend)
        return self.output(self.intermediate(attended), attended)


class BertEncoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))

    def forward(self, x: torch.Tensor, attend: torch.Tensor | None) -> torch.Tensor:
        for layer in self.layer:
            x = layer(x, attend)
        return x


class BertPooler(nn.Module):
    """tanh(dense(hidden state of the first token, [CLS]))."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.embeddings = BertEmbeddings(config)
        self.encoder = BertEncoder(config)
        self.pooler = BertPooler(config)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None):
        """Returns (hidden states (B, T, H), pooled [CLS] state (B, H)).

        `attention_mask` (B, T) is 1 for real tokens and 0 for padding.
        """
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        attend = None if attention_mask is None else attention_mask.bool()[:, None, None, :]  # (B, 1, 1, T)
        hidden = self.encoder(self.embeddings(input_ids, token_type_ids), attend)
        return hidden, self.pooler(hidden)


class BertPredictionHeadTransform(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(F.gelu(self.dense(x)))


class BertLMPredictionHead(nn.Module):
    """Masked-LM logits over the padded vocabulary (the padding's -inf); the decoder's weight is the word
    embedding, its bias is ``self.bias``."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.transform = BertPredictionHeadTransform(config)
        self.decoder = VocabularyOutput(config.hidden_size, config.vocab_size, config.padded_vocab_size, bias=True)
        self.bias = nn.Parameter(torch.zeros(config.padded_vocab_size))
        self.decoder.bias = self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., H) -> (..., padded)
        return self.decoder(self.transform(x))


class BertPreTrainingHeads(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.predictions = BertLMPredictionHead(config)
        self.seq_relationship = nn.Linear(config.hidden_size, 2)

    def forward(self, hidden: torch.Tensor, pooled: torch.Tensor):
        return self.predictions(hidden), self.seq_relationship(pooled)


class _BertPreTrainedModel(PretrainedModel):
    """Initialisation, and how BERT meets Hugging Face's checkpoints (see PretrainedModel): shared by both heads."""

    config: BertConfig
    bert: BertModel

    checkpoint_key_to_name = staticmethod(checkpoint_key_to_name)
    _config_from_hf = staticmethod(config_from_hf)
    _config_from_tensors = staticmethod(config_from_tensors)
    _vocabulary_tensors: tuple[str, ...] = ("bert.embeddings.word_embeddings.weight",)
    _position_embeddings = "bert.embeddings.position_embeddings.weight"

    def init_module(self, module: nn.Module) -> None:
        """Initialises `module`'s own parameters (not its submodules') as BERT does.

        Weights normal(0, 0.02), biases zero, LayerNorm weight one, the vocabulary's padding rows zero.
        The model builds on meta and calls this per module (``models/initialization.py``); fsdp_mpi's
        deferred initialisation takes it as ``param_init_fn``.
        """
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module is self.bert.embeddings.word_embeddings or isinstance(module, VocabularyOutput):  # tied
            zero_padding(module.weight, self.config.vocab_size)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)
        if isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)
        if isinstance(module, BertLMPredictionHead):
            nn.init.zeros_(module.bias)

    def _tie_weights(self) -> None:
        """The masked-LM decoder shares the word embedding (pre-training heads only)."""

    def _hf_config(self) -> dict:
        return config_to_hf(self.config, type(self).__name__)

    def _layers_and_width(self) -> tuple[int, int]:
        return self.config.num_hidden_layers, self.config.hidden_size


class BertForPreTraining(_BertPreTrainedModel):
    """BERT with the masked-LM and next-sentence-prediction heads."""

    _vocabulary_tensors = ("bert.embeddings.word_embeddings.weight", "cls.predictions.bias",
                           "cls.predictions.decoder.weight", "cls.predictions.decoder.bias")

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.bert = BertModel(config)
            self.cls = BertPreTrainingHeads(config)
        finish_construction(self, self._tie_weights)

    def _tie_weights(self) -> None:
        predictions = self.cls.predictions
        predictions.decoder.weight = self.bert.embeddings.word_embeddings.weight
        predictions.decoder.bias = predictions.bias

    def training_flops_per_token(self, seq_len: int, predicted_fraction: float = 1.0) -> float:
        """As the base class's, with the masked-LM head (transform and vocabulary projection) run on only
        `predicted_fraction` of the positions, as ``forward(predict_positions=...)`` does."""
        head = self.cls.predictions
        head_weights = head.transform.dense.weight.numel() + self.config.vocab_size * self.config.hidden_size
        return super().training_flops_per_token(seq_len) - 6 * (1 - predicted_fraction) * head_weights

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, mlm_labels=None, nsp_labels=None,
                predict_positions=None):
        """Returns (masked-LM logits (B, T, vocab), NSP logits (B, 2), loss or None).

        The loss is masked-LM cross-entropy over positions whose label is not -100,
        plus NSP cross-entropy, when both label tensors are given. With
        `predict_positions` (bool (B, T)), the masked-LM head runs only there and its
        logits are (positions, vocab) in row-major order: in pre-training the vocabulary
        projection is most of a small BERT's work, and only the masked 15% need it. The masked-LM logits
        are a view of the padded vocabulary's without the padding (see ``GPT2LMHeadModel.forward``).
        """
        hidden, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        if predict_positions is not None:
            hidden = hidden[predict_positions]  # (positions, H)
        mlm_logits, nsp_logits = self.cls(hidden, pooled)
        loss = None
        if mlm_labels is not None and nsp_labels is not None:
            if predict_positions is not None:
                mlm_labels = mlm_labels[predict_positions]
            mlm_loss = cross_entropy(mlm_logits.view(-1, mlm_logits.shape[-1]), mlm_labels.reshape(-1),
                                     ignore_index=IGNORE_INDEX)
            loss = mlm_loss + cross_entropy(nsp_logits, nsp_labels)  # fp32 under mixed precision
        return mlm_logits[..., :self.config.vocab_size], nsp_logits, loss


class BertForSequenceClassification(_BertPreTrainedModel):
    """BERT with a linear classifier on the pooled [CLS] state."""

    checkpoint_key_to_name = staticmethod(classifier_checkpoint_key_to_name)
    _fresh_heads = ("classifier.",)

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        with torch.device("meta"):
            self.bert = BertModel(config)
            self.dropout = nn.Dropout(config.hidden_dropout_prob)
            self.classifier = nn.Linear(config.hidden_size, config.num_labels)
        finish_construction(self, self._tie_weights)

    def forward(self, input_ids, token_type_ids=None, attention_mask=None, labels=None):
        """Returns (logits (B, num_labels), cross-entropy against `labels` (B,) or None)."""
        _, pooled = self.bert(input_ids, token_type_ids, attention_mask)
        logits = self.classifier(self.dropout(pooled))
        loss = None if labels is None else cross_entropy(logits, labels)
        return logits, loss

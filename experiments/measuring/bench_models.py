"""The models ``bench.py`` times: GPT-2 (language modelling) or BERT (pre-training) by configuration name.

Each comes without dropout, with its sharding unit, a synthetic batch and its training FLOPs per token.
A batch is the model's positional arguments, and the loss is the model's last output, for both.
BERT's batch masks ``MASKED_FRACTION`` of the tokens and runs the masked-LM head there only, as
``run_bert.py`` trains it.
"""

import torch
from torch import nn

from fsdp_mpi_models.bert import BERT_CONFIGS, BertForPreTraining, BertLayer, bert_config
from fsdp_mpi_models.gpt2 import GPT2_CONFIGS, GPT2Block, GPT2LMHeadModel, gpt2_config

NAMES = [*GPT2_CONFIGS, *BERT_CONFIGS]
MASKED_FRACTION = 0.15  # of BERT's tokens, predicted by its masked-LM head


def build(name: str, vocab_size: int | None = None, layers: int | None = None) -> nn.Module:
    """Model `name` without dropout, with `vocab_size` words and `layers` blocks (None: the configuration's own)."""
    overrides = {} if vocab_size is None else {"vocab_size": vocab_size}
    if name in BERT_CONFIGS:
        if layers is not None:
            overrides["num_hidden_layers"] = layers
        return BertForPreTraining(bert_config(name, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                              **overrides))
    if layers is not None:
        overrides["n_layer"] = layers
    return GPT2LMHeadModel(gpt2_config(name, dropout=0.0, **overrides))


def context_length(name: str) -> int:
    return BERT_CONFIGS[name].max_position_embeddings if name in BERT_CONFIGS else gpt2_config(name).n_positions


def unit_class(model: nn.Module) -> type:
    """The block that fsdp-mpi and FSDP2 shard as a unit, and that ``+compile`` compiles in place."""
    return BertLayer if isinstance(model, BertForPreTraining) else GPT2Block


def flops_per_token(model: nn.Module, seq_len: int) -> float:
    if isinstance(model, BertForPreTraining):
        return model.training_flops_per_token(seq_len, predicted_fraction=MASKED_FRACTION)
    return model.training_flops_per_token(seq_len)


def synthetic_batch(model: nn.Module, batch_size: int, seq_len: int, rank: int, device: torch.device) -> tuple:
    """Random tokens, the same on every run of a rank: (inputs, targets) for GPT-2; (input_ids, token types,
    attention mask, masked-LM labels, next-sentence labels, predicted positions) for BERT."""
    generator = torch.Generator().manual_seed(1234 + rank)
    vocab_size = model.config.vocab_size
    if not isinstance(model, BertForPreTraining):
        tokens = torch.randint(vocab_size, (batch_size, seq_len + 1), generator=generator).to(device)
        return tokens[:, :-1], tokens[:, 1:]
    input_ids = torch.randint(vocab_size, (batch_size, seq_len), generator=generator)
    predicted = torch.rand(batch_size, seq_len, generator=generator) < MASKED_FRACTION
    labels = torch.where(predicted, input_ids, -100)
    token_types = (torch.arange(seq_len) >= seq_len // 2).long().expand(batch_size, seq_len)  # two "sentences"
    next_sentence = torch.randint(2, (batch_size,), generator=generator)
    batch = (input_ids, token_types, None, labels, next_sentence, predicted)
    return tuple(None if t is None else t.to(device) for t in batch)

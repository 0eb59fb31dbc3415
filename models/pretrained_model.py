"""What our GPT-2 and BERT share: Hugging Face loading and saving, the padded vocabulary's rows, counts and FLOPs.

Each model is laid out like its Hugging Face counterpart, so that published
checkpoints load unchanged (``models/checkpoint.py`` reads and writes them). A
model says how its family meets that layout in a few class attributes (listed on
``PretrainedModel``); the methods here read them, so loading, saving, the
parameter count and MFU's FLOPs are each written once for every model.
"""

from dataclasses import replace
from pathlib import Path

from torch import nn

from .checkpoint import load_into, read_checkpoint, save


class PretrainedModel(nn.Module):
    """A model built from ``config`` (a frozen dataclass with ``vocab_size`` and ``padded_vocab_size``) that reads
    and writes Hugging Face's checkpoints.

    A subclass sets:
        checkpoint_key_to_name: a published checkpoint's key -> our parameter's name, or None to skip it.
        _config_from_hf: a Hugging Face ``config.json`` (a dict) -> our config.
        _config_from_tensors: a checkpoint's tensors -> our config, for a checkpoint without config.json.
        _vocabulary_tensors: the names of the tensors that hold the padded vocabulary's rows.
        _position_embeddings: the name of the position embeddings' weight, which MFU's count leaves out.
        _fresh_heads: name prefixes a published checkpoint may lack (a task head that starts fresh).
    and defines ``_hf_config()`` (its ``config.json``) and ``_layers_and_width()`` (what attention's FLOPs grow with).
    """

    _fresh_heads: tuple[str, ...] = ()

    @classmethod
    def from_pretrained(cls, path: str | Path, **overrides) -> "PretrainedModel":
        """Loads a Hugging Face checkpoint (a directory with config.json, or a weights file).

        `overrides` change config fields that do not affect weights (dropout, gradient_checkpointing, or a fresh
        head's size: a sequence classifier may load a pre-training checkpoint, and its classifier starts fresh).
        """
        tensors, hf_config = read_checkpoint(path)
        config = cls._config_from_hf(hf_config) if hf_config else cls._config_from_tensors(tensors)
        model = cls(replace(config, **overrides))
        load_into(model, tensors, model.checkpoint_key_to_name, may_be_missing=model._fresh_heads,
                  rows=model.checkpoint_rows())
        return model

    def save_pretrained(self, directory: str | Path) -> Path:
        """Writes model.safetensors and config.json that both this class and transformers can load."""
        return save(self, directory, self._hf_config(), rows=self.checkpoint_rows())

    def checkpoint_rows(self) -> dict[str, int]:
        """The tensors a Hugging Face checkpoint holds only the first rows of: the padded vocabulary's
        (name -> real rows; empty when nothing is padded)."""
        config = self.config
        if config.padded_vocab_size == config.vocab_size:
            return {}
        return dict.fromkeys(self._vocabulary_tensors, config.vocab_size)

    def num_parameters(self, exclude_position_embeddings: bool = False) -> int:
        """Parameter count, each tied weight once, the vocabulary's padding left out (as published: gpt2 has
        124,439,808, bert-base 110,106,428); so MFU counts the model's FLOPs, not the padding's."""
        rows = self.checkpoint_rows()
        padding = sum(p[self.config.vocab_size:].numel() for name, p in self.named_parameters() if name in rows)
        count = sum(p.numel() for p in self.parameters()) - padding
        if exclude_position_embeddings:
            count -= self.get_parameter(self._position_embeddings).numel()
        return count

    def training_flops_per_token(self, seq_len: int) -> float:
        """Forward plus backward FLOPs per token: 6N for the weights plus 12 L C T for attention scores
        (L layers of width C, T = `seq_len` tokens)."""
        layers, width = self._layers_and_width()
        return 6 * self.num_parameters(exclude_position_embeddings=True) + 12 * layers * width * seq_len

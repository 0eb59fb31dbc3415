"""BERT's sizes (``BertConfig``), and Hugging Face's ``config.json`` for them, read and written.

The field names are Hugging Face's, so that a published ``config.json`` maps onto
ours by name; the named sizes (``bert_config("bert-base")``) are in ``models/bert.py``.
"""

from dataclasses import dataclass

from .vocabulary import MULTIPLE, padded_size


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    layer_norm_eps: float = 1e-12
    num_labels: int = 2  # for sequence classification
    gradient_checkpointing: bool = False
    vocab_multiple: int = MULTIPLE  # the embedding and masked-LM decoder hold vocab_size rounded up to this

    @property
    def padded_vocab_size(self) -> int:
        return padded_size(self.vocab_size, self.vocab_multiple)


_SHARED_HF_FIELDS = (
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
    "max_position_embeddings", "type_vocab_size", "hidden_dropout_prob", "attention_probs_dropout_prob",
    "layer_norm_eps",
)


def config_from_hf(hf: dict) -> BertConfig:
    """Our config from a Hugging Face BERT ``config.json``."""
    values = {name: hf[name] for name in _SHARED_HF_FIELDS if name in hf}
    if "id2label" in hf:
        values["num_labels"] = len(hf["id2label"])
    return BertConfig(**values)


def config_to_hf(config: BertConfig, architecture: str) -> dict:
    """A Hugging Face BERT ``config.json`` for our config."""
    return {
        "model_type": "bert",
        "architectures": [architecture],
        **{name: getattr(config, name) for name in _SHARED_HF_FIELDS},
        "hidden_act": "gelu",
        "id2label": {str(i): f"LABEL_{i}" for i in range(config.num_labels)},
        "label2id": {f"LABEL_{i}": i for i in range(config.num_labels)},
        "tie_word_embeddings": True,
    }


def config_from_tensors(tensors: dict) -> BertConfig:
    """Infers a config from checkpoint shapes when there is no config.json (heads of 64 dims, as in BERT)."""
    def find(suffix):
        return next(t for k, t in tensors.items() if k.endswith(suffix))

    vocab_size, hidden = find("word_embeddings.weight").shape
    layers = {k.split("encoder.layer.")[1].split(".")[0] for k in tensors if "encoder.layer." in k}
    return BertConfig(
        vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=len(layers),
        num_attention_heads=max(hidden // 64, 1), intermediate_size=find("intermediate.dense.weight").shape[0],
        max_position_embeddings=find("position_embeddings.weight").shape[0],
        type_vocab_size=find("token_type_embeddings.weight").shape[0],
    )

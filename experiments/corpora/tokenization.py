"""Tokenizers: GPT-2 byte-level BPE and BERT WordPiece from their vocabulary files, and characters."""

import json
from pathlib import Path

from corpora.files import data_file


class CharTokenizer:
    """One token per distinct character of a text (65 for Tiny Shakespeare)."""

    kind = "char"

    def __init__(self, characters: str):
        self.characters = characters
        self._ids = {c: i for i, c in enumerate(characters)}
        self.vocab_size = len(characters)

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    def encode(self, text: str) -> list[int]:
        unknown = set(text) - set(self._ids)
        if unknown:
            raise ValueError(f"characters not in the vocabulary: {''.join(sorted(unknown))!r}")
        return [self._ids[c] for c in text]

    def decode(self, ids) -> str:
        return "".join(self.characters[i] for i in ids)

    def describe(self) -> dict:
        return {"kind": self.kind, "characters": self.characters}


class GPT2Tokenizer:
    """GPT-2's byte-level BPE (50,257 tokens) through Hugging Face ``tokenizers``."""

    kind = "gpt2"
    end_of_text = 50256

    def __init__(self, data_dir: Path, download: bool = True):
        from tokenizers import ByteLevelBPETokenizer

        vocab = data_file(data_dir, "tokenizers/gpt2/vocab.json", download)
        merges = data_file(data_dir, "tokenizers/gpt2/merges.txt", download)
        self._tokenizer = ByteLevelBPETokenizer(str(vocab), str(merges))
        self.vocab_size = self._tokenizer.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text).ids

    def decode(self, ids) -> str:
        return self._tokenizer.decode(list(ids))

    def describe(self) -> dict:
        return {"kind": self.kind}


class BertTokenizer:
    """BERT's uncased WordPiece (30,522 tokens); encodes sentence pairs with [CLS] and [SEP]."""

    def __init__(self, data_dir: Path, download: bool = True):
        from tokenizers import BertWordPieceTokenizer

        vocab = data_file(data_dir, "tokenizers/bert-base-uncased/vocab.txt", download)
        self._tokenizer = BertWordPieceTokenizer(str(vocab), lowercase=True)
        self.vocab_size = self._tokenizer.get_vocab_size()
        self.pad_id, self.cls_id, self.sep_id, self.mask_id = (
            self._tokenizer.token_to_id(t) for t in ("[PAD]", "[CLS]", "[SEP]", "[MASK]")
        )

    def encode(self, text: str, pair: str | None = None) -> list[int]:
        return self._tokenizer.encode(text, pair).ids

    def encode_words(self, texts: list[str]) -> list[list[int]]:
        """Token ids of each text without special tokens."""
        return [e.ids for e in self._tokenizer.encode_batch(texts, add_special_tokens=False)]


def tokenizer_from_description(description: dict, data_dir: Path):
    """Rebuilds a GPT tokenizer saved next to a model by ``describe()``."""
    if description["kind"] == "char":
        return CharTokenizer(description["characters"])
    return GPT2Tokenizer(data_dir)


def save_description(tokenizer, directory: Path) -> None:
    (directory / "tokenizer.json").write_text(json.dumps(tokenizer.describe()))

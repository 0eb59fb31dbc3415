"""The text the experiments train on. Read in this order: files (where the corpora and vocabularies are: Tiny
Shakespeare embedded in data/, the rest fetched when missing) -> tokenization (GPT-2's BPE, BERT's WordPiece,
characters) -> datasets (GPT-2's windows of tokens, BERT's segment pairs with their masks)."""

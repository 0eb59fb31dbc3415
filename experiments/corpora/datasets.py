"""Training samples for the two experiments, built from the corpora that ``files`` reads.

GPT-2: Tiny Shakespeare, split 90/10 by position, cut into non-overlapping
windows of seq_len + 1 tokens (inputs and next-token targets).

BERT: segment pairs cut from each Cornell conversation, as BERT's pre-training
cuts documents: at every turn boundary, segment A is the turns before the cut and
B the turns from it on (truncated to fit, keeping the turns nearest the cut).
Each turn reads as a script line, ``KAT: text``: who speaks is what lets a small
model tell a reply from another film's turns (without the names, next-sentence
accuracy stayed at chance on the four films of the partial corpus). Half
the B segments are replaced by a B segment from another film of the same split
(next-sentence label; BERT takes it from another document), and BERT's masking
picks 15% of tokens (80% [MASK], 10% random, 10% kept). Labels and masks are
drawn afresh each epoch from (seed, epoch, sample), so runs are reproducible.
The conversations are split 90/10 in a fixed random order (SPLIT_SEED), so both
splits draw from every film.
"""

from dataclasses import dataclass, field

import torch

from corpora.files import DataError, corpus_file, read_cornell, read_text

IGNORE_INDEX = -100
IS_NEXT, NOT_NEXT = 0, 1  # Hugging Face's next-sentence label convention
MASK_FRACTION = 0.15
SPLIT_SEED = 0  # which conversations are held out: the same in every run, whatever --seed


@dataclass
class TokenWindows:
    """Non-overlapping windows (num_samples, seq_len + 1) of a token stream."""

    windows: torch.Tensor

    def __len__(self) -> int:
        return self.windows.shape[0]

    def batch(self, indices: torch.Tensor, epoch: int) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.windows[indices]
        return rows[:, :-1], rows[:, 1:]


def shakespeare_windows(data_dir, tokenizer_factory, seq_len: int, download: bool = True):
    """(tokenizer, train windows, validation windows) for Tiny Shakespeare (the data directory's copy where it has
    one, else the embedded copy)."""
    text = read_text(corpus_file(data_dir, "tinyshakespeare/input.txt", download))
    tokenizer = tokenizer_factory(text)
    split = int(len(text) * 0.9)
    parts = []
    for part in (text[:split], text[split:]):
        tokens = torch.tensor(tokenizer.encode(part), dtype=torch.long)
        count = (len(tokens) - 1) // seq_len
        if count < 1:
            raise DataError(f"the text is too short for one window of {seq_len + 1} tokens")
        parts.append(TokenWindows(tokens[: count * seq_len + 1].unfold(0, seq_len + 1, seq_len)))
    return tokenizer, parts[0], parts[1]


@dataclass
class SentencePairs:
    """Tokenized (A, B) segment pairs of one split, masked and labelled at batch time.

    A random B (next-sentence label NOT_NEXT) is another pair's B from a different
    film, as BERT draws it from another document, when the split has more than one film.
    """

    firsts: list[list[int]]
    seconds: list[list[int]]
    movies: list[str]  # each pair's film
    seq_len: int
    seed: int
    vocab_size: int
    pad_id: int
    cls_id: int
    sep_id: int
    mask_id: int
    other_films: dict[str, list[int]] = field(init=False)  # film -> the pairs from other films (all if none)

    def __post_init__(self):
        self.other_films = {}
        for movie in set(self.movies):
            others = [i for i, other in enumerate(self.movies) if other != movie]
            self.other_films[movie] = others or list(range(len(self.movies)))

    def __len__(self) -> int:
        return len(self.firsts)

    def batch(self, indices: torch.Tensor, epoch: int):
        """(input_ids, token_type_ids, attention_mask, mlm_labels, nsp_labels) for `indices`."""
        rows = [self._sample(int(i), epoch) for i in indices]
        return tuple(torch.stack(column) for column in zip(*rows))

    def _sample(self, index: int, epoch: int):
        generator = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) * 10_000_019 + index)
        first = self.firsts[index]
        nsp_label = IS_NEXT
        second = self.seconds[index]
        if torch.rand((), generator=generator) < 0.5:
            nsp_label = NOT_NEXT
            candidates = self.other_films[self.movies[index]]
            second = self.seconds[candidates[int(torch.randint(len(candidates), (), generator=generator))]]
        first, second = _truncate_pair(first, second, self.seq_len - 3)
        ids = [self.cls_id, *first, self.sep_id, *second, self.sep_id]
        types = [0] * (len(first) + 2) + [1] * (len(second) + 1)
        input_ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        input_ids[: len(ids)] = torch.tensor(ids)
        token_type_ids = torch.zeros(self.seq_len, dtype=torch.long)
        token_type_ids[: len(types)] = torch.tensor(types)
        attention_mask = (torch.arange(self.seq_len) < len(ids)).long()
        input_ids, mlm_labels = self._mask(input_ids, attention_mask, generator)
        return input_ids, token_type_ids, attention_mask, mlm_labels, torch.tensor(nsp_label)

    def _mask(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, generator: torch.Generator):
        """BERT's masking: 15% of real, non-special tokens are predicted; of those 80/10/10."""
        candidates = attention_mask.bool() & (input_ids != self.cls_id) & (input_ids != self.sep_id)
        chosen = candidates & (torch.rand(input_ids.shape, generator=generator) < MASK_FRACTION)
        labels = torch.where(chosen, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
        roll = torch.rand(input_ids.shape, generator=generator)
        masked = input_ids.clone()
        masked[chosen & (roll < 0.8)] = self.mask_id
        random_tokens = torch.randint(self.vocab_size, input_ids.shape, generator=generator)
        replace = chosen & (roll >= 0.8) & (roll < 0.9)
        masked[replace] = random_tokens[replace]
        return masked, labels


def _truncate_pair(first: list[int], second: list[int], budget: int) -> tuple[list[int], list[int]]:
    """Shortens the longer segment until both fit in `budget`: A loses its earliest tokens, B its last,
    so that what is kept is the context nearest the cut."""
    first, second = list(first), list(second)
    while len(first) + len(second) > budget:
        if len(first) >= len(second):
            first.pop(0)
        else:
            second.pop()
    return first, second


def cornell_pairs(data_dir, tokenizer, seq_len: int, seed: int, download: bool = True):
    """(train pairs, validation pairs, Conversations) from the Cornell corpus, split 90/10 by conversation."""
    corpus = read_cornell(data_dir, download)
    order = torch.randperm(len(corpus.dialogues), generator=torch.Generator().manual_seed(SPLIT_SEED)).tolist()
    split = max(1, int(len(order) * 0.9))
    parts = []
    for chosen in (order[:split], order[split:] or order[-1:]):
        dialogues = [corpus.dialogues[i] for i in chosen]
        script_lines = [f"{speaker}: {text}"
                        for i in chosen for speaker, text in zip(corpus.speakers[i], corpus.dialogues[i])]
        tokens = tokenizer.encode_words(script_lines)
        firsts, seconds, movies, position = [], [], [], 0
        for dialogue, movie in zip(dialogues, (corpus.movies[i] for i in chosen)):
            turns = tokens[position: position + len(dialogue)]
            for cut in range(1, len(dialogue)):  # segment A: the turns before the cut; B: the turns from it on
                firsts.append([token for turn in turns[:cut] for token in turn])
                seconds.append([token for turn in turns[cut:] for token in turn])
                movies.append(movie)
            position += len(dialogue)
        if not firsts:
            raise DataError("the conversations available contain no pair of consecutive utterances")
        parts.append(SentencePairs(firsts, seconds, movies, seq_len, seed, tokenizer.vocab_size,
                                   tokenizer.pad_id, tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id))
    return parts[0], parts[1], corpus

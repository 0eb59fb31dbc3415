"""Data for the experiments: where files come from, per-rank slices, masking, labels, tokenizers."""

import gzip
import hashlib
import io
import math
import os
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from corpora import files
from corpora.datasets import IGNORE_INDEX, NOT_NEXT, SentencePairs, _truncate_pair, cornell_pairs, shakespeare_windows
from corpora.files import DataError, data_file, read_cornell, read_text
from corpora.tokenization import BertTokenizer, CharTokenizer, GPT2Tokenizer
from training.sampling import Batching, epoch_steps, total_optimizer_steps

pytestmark = pytest.mark.one_mpi  # no MPI in it: CI's second MPI would run it for nothing

SHARED_DATA = Path(os.environ.get("FSDP_MPI_DATA_DIR", Path(__file__).parents[2] / "shared" / "data"))
needs_shared_data = pytest.mark.skipif(not (SHARED_DATA / "tinyshakespeare").is_dir(),
                                       reason=f"no shared data at {SHARED_DATA}")


def global_steps(num_samples: int, batching: Batching, world_size: int, epoch: int) -> list[list[int]]:
    """Each optimizer step's samples over all ranks, as ``epoch_steps`` hands them out (stand-ins left out)."""
    per_rank = [epoch_steps(num_samples, batching, SimpleNamespace(rank=r, world_size=world_size), epoch, seed=1)
                for r in range(world_size)]
    assert len({len(steps) for steps in per_rank}) == 1  # every rank takes part in every step
    return [sorted(i for steps in step for micro in steps if micro.weight for i in micro.indices.tolist())
            for step in zip(*per_rank)]


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("num_samples,batch_size", [(23, 4), (24, 4), (5, 8)])
def test_every_sample_is_used_exactly_once_per_epoch(world_size, num_samples, batch_size):
    for epoch in range(3):
        steps = global_steps(num_samples, Batching(batch_size), world_size, epoch)
        assert sorted(i for step in steps for i in step) == list(range(num_samples))
        assert len(steps) == math.ceil(num_samples / (batch_size * world_size))
    first = global_steps(23, Batching(4), 2, epoch=0)
    assert first != global_steps(23, Batching(4), 2, epoch=1)  # reshuffled
    assert first == global_steps(23, Batching(4), 2, epoch=0)  # deterministic


@pytest.mark.parametrize("num_samples", [23, 24])
def test_a_run_started_on_two_ranks_takes_the_same_global_batches_on_any_number(num_samples):
    """Resumed on 1, 3 or 4 ranks, a run started on 2 (4 samples per rank in 2 micro-batches: 8 a step) trains
    each step on the same samples, each rank at most 2 of them per micro-batch."""
    started = Batching(batch_size=2, grad_accum=2, started_on=2)
    on_two = global_steps(num_samples, started, 2, epoch=1)
    assert [len(step) for step in on_two[:-1]] == [8] * (len(on_two) - 1)
    for world_size in (1, 3, 4):
        assert global_steps(num_samples, started, world_size, epoch=1) == on_two, world_size
        for step in epoch_steps(num_samples, started, SimpleNamespace(rank=0, world_size=world_size), 1, seed=1):
            assert all(len(micro.indices) <= 2 for micro in step)
    assert total_optimizer_steps(num_samples, started, 3, 1) == total_optimizer_steps(num_samples, started, 3, 2)


@needs_shared_data
def test_tokenizers_give_the_reference_ids():
    assert GPT2Tokenizer(SHARED_DATA, download=False).encode("Hello world") == [15496, 995]
    assert BertTokenizer(SHARED_DATA, download=False).encode("hello world") == [101, 7592, 2088, 102]
    chars = CharTokenizer.from_text("hello")
    assert chars.decode(chars.encode("hole")) == "hole" and chars.vocab_size == 4


@needs_shared_data
def test_shakespeare_windows_are_shifted_next_token_pairs():
    tokenizer, train, val = shakespeare_windows(SHARED_DATA, CharTokenizer.from_text, 32, download=False)
    assert tokenizer.vocab_size == 65
    inputs, targets = train.batch(torch.tensor([0, 5]), epoch=0)
    assert inputs.shape == targets.shape == (2, 32)
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    assert tokenizer.decode(inputs[0].tolist()).startswith("First Citizen")
    assert 8.5 < len(train) / len(val) < 9.5  # 90/10 split


@needs_shared_data
def test_partial_cornell_copy_keeps_only_complete_conversations():
    corpus = read_cornell(SHARED_DATA, download=False)
    assert corpus.total == 83_097
    assert len(corpus.dialogues) == 544 and corpus.skipped == 83_097 - 544


@needs_shared_data
def test_masking_ratios_and_next_sentence_balance():
    tokenizer = BertTokenizer(SHARED_DATA, download=False)
    train, _, _ = cornell_pairs(SHARED_DATA, tokenizer, seq_len=64, seed=0, download=False)
    input_ids, token_types, attention, labels, nsp = train.batch(torch.arange(len(train)), epoch=0)
    predicted = labels != IGNORE_INDEX
    special = (input_ids == tokenizer.cls_id) | (input_ids == tokenizer.sep_id)
    candidates = attention.bool() & (~special | predicted)  # real tokens other than [CLS] and [SEP]
    assert predicted.sum() / candidates.sum() == pytest.approx(0.15, abs=0.015)
    replaced_by_mask = (input_ids[predicted] == tokenizer.mask_id).float().mean()
    kept = (input_ids[predicted] == labels[predicted]).float().mean()
    assert replaced_by_mask == pytest.approx(0.8, abs=0.03)
    assert kept == pytest.approx(0.1 + 0.1 / tokenizer.vocab_size, abs=0.03)
    assert (nsp == NOT_NEXT).float().mean() == pytest.approx(0.5, abs=0.05)
    assert (input_ids[:, 0] == tokenizer.cls_id).all() and token_types.max() == 1
    again = train.batch(torch.arange(4), epoch=0)[0]
    assert torch.equal(again, input_ids[:4])  # reproducible
    assert not torch.equal(train.batch(torch.arange(4), epoch=1)[0], again)  # fresh masks each epoch


def test_missing_file_without_download_says_where_to_put_it(tmp_path):
    with pytest.raises(DataError) as error:
        data_file(tmp_path, "tokenizers/gpt2/vocab.json", download=False)
    message = str(error.value)
    assert str(tmp_path / "tokenizers/gpt2/vocab.json") in message
    assert files.SOURCES["tokenizers/gpt2/vocab.json"] in message and "--data-dir" in message


TINY_SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"  # char-rnn's input.txt


def test_tiny_shakespeare_is_embedded_byte_for_byte_and_read_without_a_data_directory(tmp_path):
    embedded = files.EMBEDDED["tinyshakespeare/input.txt"]
    assert hashlib.sha256(gzip.decompress(embedded.read_bytes())).hexdigest() == TINY_SHAKESPEARE_SHA256
    tokenizer, train, val = shakespeare_windows(tmp_path, CharTokenizer.from_text, 32, download=False)
    assert tokenizer.vocab_size == 65 and tokenizer.decode(train.windows[0].tolist()).startswith("First Citizen")
    assert not list(tmp_path.iterdir())  # nothing fetched or written


def test_a_data_directorys_own_tiny_shakespeare_is_read_instead(tmp_path):
    (tmp_path / "tinyshakespeare").mkdir()
    (tmp_path / "tinyshakespeare/input.txt").write_text("abcd" * 100)
    tokenizer, _, _ = shakespeare_windows(tmp_path, CharTokenizer.from_text, 8, download=False)
    assert tokenizer.characters == "abcd"


def test_download_extracts_cornell_files_from_the_zip(tmp_path, monkeypatch):
    conversations = b"u0 +++$+++ u1 +++$+++ m0 +++$+++ ['L1', 'L2']\n"
    lines = b"L1 +++$+++ u0 +++$+++ m0 +++$+++ A +++$+++ Hi.\nL2 +++$+++ u1 +++$+++ m0 +++$+++ B +++$+++ Hello.\n"
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("cornell movie-dialogs corpus/movie_conversations.txt", conversations)
        z.writestr("cornell movie-dialogs corpus/movie_lines.txt", lines)
    monkeypatch.setattr(files.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(archive.getvalue()))
    monkeypatch.setitem(files.PINS, "cornell_movie_dialogs/movie_conversations.txt",  # pinned as these small ones
                        files.Pin(len(conversations), hashlib.sha256(conversations).hexdigest()))
    monkeypatch.setitem(files.PINS, "cornell_movie_dialogs/movie_lines.txt", files.Pin(git_blob=files.git_blob_id(lines)))
    corpus = read_cornell(tmp_path)
    assert corpus.dialogues == [["Hi.", "Hello."]] and corpus.speakers == [["A", "B"]] and corpus.skipped == 0
    assert (tmp_path / "cornell_movie_dialogs/movie_lines.txt").is_file()


@needs_shared_data
@pytest.mark.parametrize("damage", ["as published", "one byte changed", "truncated", "not a zip"])
def test_a_download_is_written_only_as_published(damage, tmp_path, monkeypatch):
    """Each fetched file is checked against its pin before it reaches the data directory: the published bytes
    are written; a changed, short or unreadable download is refused naming the file and both digests (or
    sizes), and leaves nothing behind. movie_lines.txt is pinned by git's object id (no SHA-256 of it is known
    here): a stand-in pinned the same way shows that check."""
    name = "tokenizers/gpt2/merges.txt" if damage != "not a zip" else "cornell_movie_dialogs/movie_lines.txt"
    published = (SHARED_DATA / name).read_bytes() if damage != "not a zip" else b"not a zip"
    served = {"as published": published, "one byte changed": published[:100] + b"#" + published[101:],
              "truncated": published[:-1000], "not a zip": published}[damage]
    monkeypatch.setattr(files.urllib.request, "urlopen", lambda url, timeout: io.BytesIO(served))
    if damage == "as published":
        assert data_file(tmp_path, name).read_bytes() == published
        return
    with pytest.raises(DataError) as refused:
        data_file(tmp_path, name)
    message = str(refused.value)
    assert name in message and "nothing was written" in message.lower()
    expected = {"one byte changed": f"SHA-256 {hashlib.sha256(served).hexdigest()} where {files.PINS[name].sha256}",
                "truncated": f"{len(served):,} bytes where {len(published):,} were expected",
                "not a zip": "is not the corpus's zip"}[damage]
    assert expected in message
    assert [path for path in tmp_path.rglob("*") if path.is_file()] == []


def test_a_git_object_id_pins_a_file_and_its_size():
    lines = b"L1 +++$+++ u0 +++$+++ m0 +++$+++ A +++$+++ Hi.\n"
    pin = files.Pin(git_blob="ddb69ddae910fbb85ebe0fb376803ddb8ffc5ccd")  # git hash-object of those bytes
    assert files.git_blob_id(lines) == pin.git_blob and pin.mismatch(lines) is None
    assert "git object id" in pin.mismatch(lines[:-1]) and "git object id" in pin.mismatch(lines.upper())


def test_unreadable_text_is_reported(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match="is empty"):
        read_text(tmp_path / "empty.txt")
    with pytest.raises(DataError, match="is not UTF-8 text"):
        read_text(tmp_path / "latin1.txt")


def test_segment_pairs_cut_conversations_at_each_turn_and_draw_random_segments_from_other_films():
    pairs = SentencePairs(firsts=[[5, 6], [7]], seconds=[[8], [9, 10]], movies=["m0", "m1"], seq_len=8, seed=0,
                          vocab_size=20, pad_id=0, cls_id=1, sep_id=2, mask_id=3)
    assert pairs.other_films == {"m0": [1], "m1": [0]}
    for epoch in range(20):  # segment B's length shows which B a pair got: [8] has 1 token, [9, 10] 2
        _, token_types, _, _, nsp = pairs.batch(torch.tensor([0, 1]), epoch)
        b_lengths = (token_types.sum(dim=1) - 1).tolist()  # B's tokens and its closing [SEP]
        assert b_lengths == [2 if nsp[0] == NOT_NEXT else 1, 1 if nsp[1] == NOT_NEXT else 2]
    # Too long: A loses its earliest tokens and B its last, keeping the tokens nearest the cut.
    assert _truncate_pair([1, 2, 3, 4], [5, 6, 7], 5) == ([3, 4], [5, 6, 7])
    assert _truncate_pair([1], [5, 6, 7, 8, 9], 4) == ([1], [5, 6, 7])


@needs_shared_data
def test_cornell_pairs_hold_out_conversations_of_every_film():
    tokenizer = BertTokenizer(SHARED_DATA, download=False)
    train, val, corpus = cornell_pairs(SHARED_DATA, tokenizer, seq_len=64, seed=0, download=False)
    assert set(train.movies) == set(val.movies) == set(corpus.movies) == {"m0", "m1", "m2", "m3"}
    # One pair per turn boundary: the 1,880 turns of the 544 complete conversations give 1,336 pairs.
    assert len(train) + len(val) == sum(len(d) - 1 for d in corpus.dialogues) == 1336
    again, _, _ = cornell_pairs(SHARED_DATA, tokenizer, seq_len=64, seed=5, download=False)
    assert again.firsts == train.firsts  # the held-out conversations do not depend on --seed
    # Each turn is a script line: the speaker's name, a colon, the utterance.
    conversation = corpus.dialogues.index(["They do to!", "They do not!"])
    assert corpus.speakers[conversation] == ["CAMERON", "BIANCA"]
    first_pair = tokenizer.encode_words(["CAMERON: They do to!", "BIANCA: They do not!"])
    assert [first_pair[0], first_pair[1]] in [[a, b] for a, b in zip(train.firsts + val.firsts,
                                                                     train.seconds + val.seconds)]

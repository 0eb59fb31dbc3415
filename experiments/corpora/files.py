"""Where the corpora and vocabularies come from, and how they are read.

Tiny Shakespeare ships with the repository (``data/tinyshakespeare.txt.gz`` beside
this file), so that the default GPT-2 run needs no data directory and no network;
a data directory's own ``tinyshakespeare/input.txt`` is read instead where it has one.

Lookup order for the data directory: ``--data-dir``, then ``$FSDP_MPI_DATA_DIR``,
then ``~/.cache/fsdp_mpi/data`` (``$XDG_CACHE_HOME`` respected). A file missing
there is downloaded from its public source when the machine is online;
otherwise the error names the file and where to put it. Every file fetched is
checked against its pin (``PINS``: size and SHA-256, or git's object id where
that is the one identity known) before it is written into the data directory: a
short or altered download is refused, naming the file and both digests, and
leaves nothing behind. The layout is the one of the repository's ``shared/data``::

    tinyshakespeare/input.txt                         (optional: the embedded copy otherwise)
    cornell_movie_dialogs/movie_lines.txt             (or movie_lines.PARTIAL_first_1885_lines.txt)
    cornell_movie_dialogs/movie_conversations.txt
    tokenizers/gpt2/vocab.json, tokenizers/gpt2/merges.txt
    tokenizers/bert-base-uncased/vocab.txt
"""

import gzip
import hashlib
import io
import os
import urllib.request
import zipfile
from dataclasses import dataclass
from pathlib import Path

DATA_DIR_ENV = "FSDP_MPI_DATA_DIR"

# Corpora that ship with the repository (data/README.md says where from): used when the data directory lacks them.
EMBEDDED = {"tinyshakespeare/input.txt": Path(__file__).parent / "data" / "tinyshakespeare.txt.gz"}

_CORNELL_ZIP = "https://www.cs.cornell.edu/~cristian/data/cornell_movie_dialogs_corpus.zip"
SOURCES = {
    "tokenizers/gpt2/vocab.json": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
    "tokenizers/gpt2/merges.txt": "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "tokenizers/bert-base-uncased/vocab.txt": "https://huggingface.co/bert-base-uncased/resolve/main/vocab.txt",
    "cornell_movie_dialogs/movie_lines.txt": _CORNELL_ZIP,
    "cornell_movie_dialogs/movie_conversations.txt": _CORNELL_ZIP,
}


@dataclass(frozen=True)
class Pin:
    """What a fetched file must be: its size and SHA-256, or, where no SHA-256 of it is known, git's object id (the
    SHA-1 of a header with its size, then its bytes: it pins the size too)."""

    size: int | None = None
    sha256: str | None = None
    git_blob: str | None = None

    def mismatch(self, payload: bytes) -> str | None:
        """What is wrong with `payload` (expected against actual), or None."""
        if self.size is not None and len(payload) != self.size:
            return f"{len(payload):,} bytes where {self.size:,} were expected"
        if self.sha256 is not None and (actual := hashlib.sha256(payload).hexdigest()) != self.sha256:
            return f"SHA-256 {actual} where {self.sha256} was expected"
        if self.git_blob is not None and (actual := git_blob_id(payload)) != self.git_blob:
            return f"git object id {actual} where {self.git_blob} was expected ({len(payload):,} bytes)"
        return None


def git_blob_id(payload: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(payload) + payload).hexdigest()


# The published files, as shared/data's README records them (the tokenizers' digests are those tiktoken and
# Hugging Face pin); of the full movie_lines.txt, which no copy here has, only its git object id is known.
PINS = {
    "tokenizers/gpt2/vocab.json": Pin(1_042_301, "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
    "tokenizers/gpt2/merges.txt": Pin(456_318, "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "tokenizers/bert-base-uncased/vocab.txt": Pin(
        231_508, "07eced375cec144d27c900241f3e339478dec958f92fddbc551f295c992038a3"),
    "cornell_movie_dialogs/movie_conversations.txt": Pin(
        6_760_930, "600bc1d34ca629533643ca85c14b18849a548dce663e6d36977c14f24b75e055"),
    "cornell_movie_dialogs/movie_lines.txt": Pin(git_blob="66ea02a571e1c98f42bc216ccac6e29ccb406abe"),
}
PARTIAL_MOVIE_LINES = "cornell_movie_dialogs/movie_lines.PARTIAL_first_1885_lines.txt"
CORNELL_SEPARATOR = " +++$+++ "


class DataError(Exception):
    """Data that is missing, unreadable or unusable; the message says what to do."""


def default_data_dir(explicit: str | None = None) -> Path:
    if explicit:
        return Path(explicit).expanduser()
    if os.environ.get(DATA_DIR_ENV):
        return Path(os.environ[DATA_DIR_ENV]).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
    return cache / "fsdp_mpi" / "data"


def _download(relative: str, target: Path) -> None:
    """Fetches `relative` into `target`, whole and as pinned, or raises and leaves nothing there."""
    url = SOURCES[relative]
    with urllib.request.urlopen(url, timeout=30) as response:
        payload = response.read()
    if url == _CORNELL_ZIP:
        try:
            with zipfile.ZipFile(io.BytesIO(payload)) as archive:
                member = next(name for name in archive.namelist() if name.endswith("/" + Path(relative).name))
                payload = archive.read(member)
        except (zipfile.BadZipFile, StopIteration) as error:
            raise DataError(f"{url} is not the corpus's zip, or lacks {Path(relative).name} ({error!r}): "
                            f"nothing was written to {target}") from error
    wrong = PINS[relative].mismatch(payload)
    if wrong:
        raise DataError(f"the download of {relative} from {url} is not the published file: {wrong}. Nothing was "
                        f"written to {target}; try again, or put a verified copy there")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(target.suffix + ".download")
    try:
        partial.write_bytes(payload)
        partial.rename(target)
    finally:
        partial.unlink(missing_ok=True)


def data_file(data_dir: Path, relative: str, download: bool = True) -> Path:
    """The path of `relative` under `data_dir`, fetched from its public source if missing."""
    path = data_dir / relative
    if path.is_file():
        return path
    if download and relative in SOURCES:
        try:
            _download(relative, path)
            return path
        except OSError as error:
            reason = f"downloading it from {SOURCES[relative]} failed ({error})"
    else:
        reason = "downloading is switched off"
    source = f" (public source: {SOURCES[relative]})" if relative in SOURCES else ""
    raise DataError(f"missing data file {path}: {reason}. Put the file there{source}, "
                    f"or point --data-dir or ${DATA_DIR_ENV} at a directory that has {relative}")


def corpus_file(data_dir: Path, relative: str, download: bool = True) -> Path:
    """The data directory's `relative` where it has one, else the embedded copy, else ``data_file``'s."""
    if relative in EMBEDDED and not (data_dir / relative).is_file():
        return EMBEDDED[relative]
    return data_file(data_dir, relative, download)


def read_text(path: Path) -> str:
    """A UTF-8 text file's contents (gzip-compressed where its name ends in .gz); a clear error if it is empty
    or not UTF-8."""
    try:
        if path.suffix == ".gz":
            with gzip.open(path, "rt", encoding="utf-8") as f:
                text = f.read()
        else:
            text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise DataError(f"{path} is not UTF-8 text (byte {error.start}: {error.reason})") from error
    if not text.strip():
        raise DataError(f"{path} is empty")
    return text


@dataclass(frozen=True)
class Conversations:
    """Cornell movie dialogues: each conversation as its utterances in order."""

    dialogues: list[list[str]]
    speakers: list[list[str]]  # who says each utterance, as the script names them ("BIANCA")
    movies: list[str]  # the film each dialogue is from (its id, "m0", ...)
    total: int  # conversations in the index, including skipped ones
    skipped: int  # conversations with at least one line missing from movie_lines


def read_cornell(data_dir: Path, download: bool = True) -> Conversations:
    """Reads the corpus, keeping only conversations whose every line is present.

    Works with the full ``movie_lines.txt`` and with a partial copy of it.
    The files are ISO-8859-1 (not UTF-8), fields separated by `` +++$+++ ``.
    """
    if (data_dir / PARTIAL_MOVIE_LINES).is_file() and not (data_dir / "cornell_movie_dialogs/movie_lines.txt").is_file():
        lines_path = data_dir / PARTIAL_MOVIE_LINES
    else:
        lines_path = data_file(data_dir, "cornell_movie_dialogs/movie_lines.txt", download)
    conversations_path = data_file(data_dir, "cornell_movie_dialogs/movie_conversations.txt", download)
    utterances = {}
    for row in lines_path.read_text(encoding="iso-8859-1").splitlines():
        fields = row.split(CORNELL_SEPARATOR)
        if len(fields) == 5:
            utterances[fields[0]] = fields[3].strip(), fields[4].strip()
    dialogues, speakers, movies, total = [], [], [], 0
    for row in conversations_path.read_text(encoding="iso-8859-1").splitlines():
        fields = row.split(CORNELL_SEPARATOR)
        if len(fields) != 4:
            continue
        total += 1
        line_ids = [part.strip(" '") for part in fields[3].strip("[] ").split(",")]
        if all(line_id in utterances for line_id in line_ids):
            speakers.append([utterances[line_id][0] for line_id in line_ids])
            dialogues.append([utterances[line_id][1] for line_id in line_ids])
            movies.append(fields[2].strip())
    if not dialogues:
        raise DataError(f"no complete conversation in {conversations_path} has its lines in {lines_path}")
    return Conversations(dialogues, speakers, movies, total, total - len(dialogues))

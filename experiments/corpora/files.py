"""Where the corpora and vocabularies come from, and how they are read.

Tiny Shakespeare ships with the repository (``data/tinyshakespeare.txt.gz`` beside
this file), so that the default GPT-2 run needs no data directory and no network;
a data directory's own ``tinyshakespeare/input.txt`` is read instead where it has one.

Lookup order for the data directory: ``--data-dir``, then ``$FSDP_MPI_DATA_DIR``,
then ``~/.cache/fsdp_mpi/data`` (``$XDG_CACHE_HOME`` respected). A file missing
there is downloaded from its public source when the machine is online;
otherwise the error names the file and where to put it. The layout is the one
of the repository's ``shared/data``::

    tinyshakespeare/input.txt                         (optional: the embedded copy otherwise)
    cornell_movie_dialogs/movie_lines.txt             (or movie_lines.PARTIAL_first_1885_lines.txt)
    cornell_movie_dialogs/movie_conversations.txt
    tokenizers/gpt2/vocab.json, tokenizers/gpt2/merges.txt
    tokenizers/bert-base-uncased/vocab.txt
"""

import gzip
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
    url = SOURCES[relative]
    with urllib.request.urlopen(url, timeout=30) as response:
        payload = response.read()
    if url == _CORNELL_ZIP:
        with zipfile.ZipFile(io.BytesIO(payload)) as archive:
            member = next(name for name in archive.namelist() if name.endswith("/" + Path(relative).name))
            payload = archive.read(member)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(target.suffix + ".download")
    partial.write_bytes(payload)
    partial.rename(target)


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

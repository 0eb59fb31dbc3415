"""Writing a directory of files so that a crash at any moment leaves either the old directory or the new one
whole: files flushed to disk, the new directory renamed into place once complete, checksums to tell a
damaged file from a whole one."""

import hashlib
import os
import shutil
from pathlib import Path


def file_info(path: Path) -> dict:
    """A file's size and sha256, as an index records them."""
    return {"bytes": path.stat().st_size, "sha256": sha256(path)}


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def write_durably(path: Path, data: bytes) -> None:
    """`data` in `path`, on the disk when this returns."""
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def prepare_empty(directory: Path) -> None:
    """An empty directory for a save, replacing what an interrupted save left there."""
    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir(parents=True)


def replace_directory(complete: Path, target: Path) -> None:
    """Renames `complete` to `target`; an existing `target` is moved aside first and removed last."""
    aside = target.with_name(target.name + ".old")
    if aside.exists():
        shutil.rmtree(aside)
    if target.exists():
        target.rename(aside)
    complete.rename(target)
    fsync_directory(target.parent)
    if aside.exists():
        shutil.rmtree(aside)


def fsync_directory(directory: Path) -> None:
    descriptor = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)

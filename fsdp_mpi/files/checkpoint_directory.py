"""A directory of step checkpoints that a run saves into and reloads from: a job killed at any moment leaves
``latest`` naming a complete one.

    DIR/step-00000123/   one ``save_checkpoint`` directory per saved step; the newest KEEP are kept
    DIR/latest           the name of the newest complete one ("step-00000123")
    DIR/run.json         what stays fixed for the whole run: the ranks it started on (its global batch)

A save writes ``step-....tmp`` and renames it into place (``checkpoint.py``), and ``latest`` is
replaced only after that. The experiments' ``--checkpoint-dir`` and ``fsdp_mpi.elastic``'s
reloads after a lost rank both use it.
"""

import json
import os
import re
import shutil
from pathlib import Path
from typing import Callable

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.files.checkpoint import save_checkpoint

KEEP = 2  # step checkpoints kept: the newest, and one more in case the newest turns out damaged
LATEST = "latest"
RUN_FILE = "run.json"
STEP_NAME = re.compile(r"step-\d{8}")


class CheckpointDirectory:
    """Step checkpoints under `root`, `latest` naming the newest, only the newest KEEP kept."""

    def __init__(self, root: str | os.PathLike, comm: Communicator):
        self.root, self.comm = Path(root), comm

    def latest(self) -> Path | None:
        """The checkpoint that `latest` names, or None. Rank 0 reads it, so that every rank gets the same."""
        name = None
        if self.comm.rank == 0 and (self.root / LATEST).is_file():
            name = (self.root / LATEST).read_text().strip()
        name = self.comm.broadcast_object(name, root=0)
        return self.root / name if name else None

    def started_on(self) -> int | None:
        """The ranks the run in this directory started on (run.json), or None before its first checkpoint
        (collective: rank 0 reads it)."""
        return self.comm.broadcast_object(self.read_started_on() if self.comm.rank == 0 else None, root=0)

    def read_started_on(self) -> int | None:
        """``started_on``, read by this rank alone (a grow-back's newcomer, while the others are busy)."""
        if not (self.root / RUN_FILE).is_file():
            return None
        return json.loads((self.root / RUN_FILE).read_text())["started_on"]

    def save(self, step: int, model, optimizer, extra: dict, started_on: int) -> Path:
        """Every rank saves its shards; then rank 0 points `latest` at them and removes older checkpoints."""
        return self.save_by(step, lambda directory: save_checkpoint(directory, model, optimizer, extra), started_on)

    def save_by(self, step: int, write: Callable[[Path], None], started_on: int) -> Path:
        """``save`` by `write` (collective: every rank writes its part of a checkpoint directory at the path it is
        given and returns once the directory is whole, as a Lightning Trainer's ``save_checkpoint`` does)."""
        directory = self.root / f"step-{step:08d}"
        write(directory)
        if self.comm.rank == 0:
            if not (self.root / RUN_FILE).exists():
                self._write_durably(RUN_FILE, json.dumps({"started_on": started_on}) + "\n")
            self._write_durably(LATEST, directory.name + "\n")
            self._remove_older_than_the_newest(directory)
        return directory

    def _write_durably(self, name: str, text: str) -> None:
        """Replaces DIR/name with `text` at once: a crash leaves the old file or the new one."""
        temporary = self.root / (name + ".tmp")
        with open(temporary, "w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, self.root / name)

    def _remove_older_than_the_newest(self, current: Path) -> None:
        """Removes the step checkpoints before `current` but the newest KEEP - 1.

        Newer ones, left by an earlier attempt that was killed before it updated `latest`,
        stay: this run saves over them as it gets there.
        """
        older = sorted(path for path in self.root.iterdir()
                       if STEP_NAME.fullmatch(path.name) and path.is_dir() and path.name <= current.name)
        for path in older[:-KEEP]:
            shutil.rmtree(path)

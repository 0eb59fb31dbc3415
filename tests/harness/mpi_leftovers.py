"""The shared-memory files MPI libraries leave in /dev/shm when the suite kills their ranks, removed at its end.

Many tests kill ranks on purpose (a lost rank, a lost node, a signal). A killed rank never runs its MPI library's
clean-up, and the segment that library made for its node's ranks stays in ``/dev/shm`` (MPICH's
``mpich_shm_*``, Open MPI's ``sm_segment.*``): RAM that nothing frees until the machine reboots. One pass of the
suite left 135 of them, 208 MB; a CI machine that runs it a hundred times would fill its ``/dev/shm``. These are
the MPI library's files, not fsdp_mpi's (the suite checks fsdp_mpi's own, by name, where it kills ranks).

At the session's end the suite removes those it made: named as an MPI library names them, changed since the
session started, and mapped by no process any more. A segment a live job maps (another session's, on a shared
machine) is left alone.
"""

import fnmatch
from pathlib import Path

SHARED_MEMORY = Path("/dev/shm")
MPI_SEGMENT_NAMES = ("mpich_shm_*", "sm_segment.*")  # MPICH's (and Intel MPI's, built on it), Open MPI's


def mapped_files() -> set[str]:
    """The paths of the files some live process maps, from every readable /proc/<pid>/maps."""
    mapped = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            lines = maps.read_text().splitlines()
        except OSError:  # the process ended while we looked, or is not ours to read
            continue
        for line in lines:  # address, permissions, offset, device, inode[, path]
            fields = line.split(None, 5)
            if len(fields) == 6:
                mapped.add(fields[5].removesuffix(" (deleted)"))
    return mapped


def remove_mpi_leftovers(since: float, folder: Path = SHARED_MEMORY) -> list[Path]:
    """Removes the MPI segments in `folder` changed at or after `since` (a time.time()) that no process maps.

    Returns what it removed. A file that vanishes meanwhile, or that is not ours to remove, is passed over.
    """
    if not folder.is_dir():
        return []
    candidates = [path for path in folder.iterdir()
                  if any(fnmatch.fnmatch(path.name, pattern) for pattern in MPI_SEGMENT_NAMES)]
    in_use = mapped_files() if candidates else set()
    removed = []
    for path in candidates:
        try:
            if path.stat().st_mtime < since or str(path) in in_use:
                continue
            path.unlink()
        except OSError:
            continue
        removed.append(path)
    return removed

"""Tests that share one thing on the machine take turns at it, also under pytest-xdist (`-n K`, as CI runs).

The emulated cluster's network namespaces and its SLURM (``hpc/cluster/cluster.sh``: fixed names, one munge)
and the local SLURM (``tests/slurm/start_local_slurm.sh``) exist once per machine: two workers starting and
stopping them at once would break each other's jobs. Each user holds an exclusive lock on one file while it
uses them; without xdist nothing waits.
"""

import contextlib
import fcntl
import tempfile
from pathlib import Path

CLUSTER_AND_SLURM = Path(tempfile.gettempdir()) / "fsdp_mpi-tests-cluster-and-slurm.lock"


@contextlib.contextmanager
def in_turn(lock: Path = CLUSTER_AND_SLURM):
    """Holds `lock` exclusively (across processes) for the body, waiting for whoever holds it now."""
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)

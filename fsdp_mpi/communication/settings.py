"""Every environment variable fsdp_mpi reads, in one place: its name, its default and what it changes.

Each is read where it takes effect, through ``read_flag`` or ``read_text`` below; a value that cannot be
read stops the run with the variable named. docs/api.md lists the same table (tests/test_layout.py
checks that the two agree). A constructor argument, where there is one (``Communicator(timeout=...)``),
wins over its variable.
"""

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str
    default: str
    meaning: str


CUDA_AWARE = Setting("FSDP_MPI_CUDA_AWARE", "the MPI library's answer",
                     "1 / 0: treat MPI as CUDA-aware or not, whatever it reports")
FORCE_STAGING = Setting("FSDP_MPI_FORCE_STAGING", "0",
                        "1: stage every buffer through host memory, also CPU ones (the node transport is then off)")
NODE_TRANSPORT = Setting("FSDP_MPI_NODE_TRANSPORT", "1",
                         "0: a communicator whose ranks are all on one node moves its bytes through MPI, not "
                         "through memory the ranks share")
TIMEOUT = Setting("FSDP_MPI_TIMEOUT", "600",
                  "seconds a rank may wait in one collective before the watchdog reports and aborts the job; 0: never")
VERIFY = Setting("FSDP_MPI_VERIFY", "0", "1: check before every collective that all ranks enter the same one")
HYBRID_GROUP_SIZE = Setting("FSDP_MPI_HYBRID_GROUP_SIZE", "the node's ranks",
                            "K: HYBRID_SHARD's shard groups are K consecutive ranks")
REUSE_HOST_MEMORY = Setting("FSDP_MPI_REUSE_HOST_MEMORY", "1",
                            "0: let glibc return freed host memory to the kernel (on by default: gathered buffers "
                            "come back every step)")

SETTINGS = (CUDA_AWARE, FORCE_STAGING, NODE_TRANSPORT, TIMEOUT, VERIFY, HYBRID_GROUP_SIZE, REUSE_HOST_MEMORY)


def read_text(setting: Setting) -> str:
    """The variable's value, stripped; "" when it is unset."""
    return os.environ.get(setting.name, "").strip()


def read_flag(setting: Setting) -> bool | None:
    """A yes/no variable; None when it is unset or empty."""
    value = read_text(setting).lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{setting.name}={os.environ[setting.name]!r}: expected 1/0, true/false, yes/no or on/off")

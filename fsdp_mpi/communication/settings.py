"""Every environment variable fsdp_mpi reads, in one place: its name, its default and what it changes.

Each is read where it takes effect, through ``read_flag``, ``read_seconds`` or ``read_count`` below, which
give the setting's default when the variable is unset; a value that cannot be read stops the run with the
variable named. docs/api.md lists the same table (tests/test_layout.py checks that the two agree). A
constructor argument, where there is one (``Communicator(timeout=...)``), wins over its variable.
"""

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Setting:
    name: str
    shown_default: str  # the default as docs/api.md says it
    meaning: str
    default: bool | float | int | None = None  # what an unset variable means (None: decided at run time)


CUDA_AWARE = Setting("FSDP_MPI_CUDA_AWARE", "the MPI library's answer",
                     "1 / 0: treat MPI as CUDA-aware or not, whatever it reports")
FORCE_STAGING = Setting("FSDP_MPI_FORCE_STAGING", "0",
                        "1: stage every buffer through host memory, also CPU ones (the node transport is then off)",
                        False)
NODE_TRANSPORT = Setting("FSDP_MPI_NODE_TRANSPORT", "1",
                         "0: ranks on one node move their bytes through MPI, not through memory they share (also "
                         "the node level of a group that spans nodes)", True)
TWO_LEVEL = Setting("FSDP_MPI_TWO_LEVEL", "1",
                    "0: a group that spans nodes sends every byte through MPI in one flat ring instead of in two "
                    "levels (inside each node, then across nodes)", True)
EMULATED_NODE_SIZE = Setting("FSDP_MPI_EMULATED_NODE_SIZE", "the machine's ranks",
                             "K, for tests and benchmarks only: consecutive blocks of K ranks act as the nodes "
                             "(one machine as several; the memory is still shared)")
TIMEOUT = Setting("FSDP_MPI_TIMEOUT", "600",
                  "seconds a rank may wait in one collective before the watchdog reports and aborts the job; 0: never "
                  "(a torch group's timeout=, at which wait() raises, where this is set and smaller)", 600.0)
VERIFY = Setting("FSDP_MPI_VERIFY", "0", "1: check before every collective that all ranks enter the same one", False)
HYBRID_GROUP_SIZE = Setting("FSDP_MPI_HYBRID_GROUP_SIZE", "the node's ranks",
                            "K: HYBRID_SHARD's shard groups are K consecutive ranks")
REUSE_HOST_MEMORY = Setting("FSDP_MPI_REUSE_HOST_MEMORY", "1",
                            "0: gathered parameters and full gradients take new host memory each time, not "
                            "buffers kept for reuse (on by default: they come back every step)", True)
OFFLOAD_STREAMS = Setting("FSDP_MPI_OFFLOAD_STREAMS", "1",
                          "0: offloaded from a GPU, shards go to the device and gradients come home by copies the "
                          "host waits for, not on streams of their own (to measure what those save)", True)

SETTINGS = (CUDA_AWARE, FORCE_STAGING, NODE_TRANSPORT, TWO_LEVEL, EMULATED_NODE_SIZE, TIMEOUT, VERIFY,
            HYBRID_GROUP_SIZE, REUSE_HOST_MEMORY, OFFLOAD_STREAMS)

# How collectives are cut, per rank: not settings of the environment, but defaults of the transports, kept here
# with the others. A Communicator can change its own (the tests cut messages small to exercise the chunking).
STAGING_CHUNK_BYTES = 4 * 2**20  # staged through pinned host memory: copies and MPI overlap chunk by chunk
HOST_EXCHANGE_BYTES = 2**20  # one exchange through a node's shared host memory: near the caches
DEVICE_EXCHANGE_BYTES = 64 * 2**20  # the same on a GPU: full copy bandwidth, little of the GPU's memory
MAX_ELEMENTS_PER_MESSAGE = 2**31 - 1  # MPI counts are C ints


def read_text(setting: Setting) -> str:
    """The variable's value, stripped; "" when it is unset."""
    return os.environ.get(setting.name, "").strip()


def read_flag(setting: Setting) -> bool | None:
    """A yes/no variable; the setting's default when it is unset or empty."""
    value = read_text(setting).lower()
    if not value:
        return setting.default
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{setting.name}={os.environ[setting.name]!r}: expected 1/0, true/false, yes/no or on/off")


def read_seconds(setting: Setting) -> float:
    """A number of seconds >= 0; the setting's default when it is unset."""
    value = read_text(setting)
    if not value:
        return setting.default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds >= 0:
        raise ValueError(f"{setting.name}={value!r}: expected a number of seconds >= 0 (0 turns the watchdog off)")
    return seconds


def read_count(setting: Setting) -> int | None:
    """A whole number >= 1; the setting's default (None: decided at run time) when it is unset."""
    value = read_text(setting)
    if not value:
        return setting.default
    if not value.isdigit() or int(value) < 1:
        raise ValueError(f"{setting.name}={value!r}: expected a whole number of ranks >= 1")
    return int(value)

"""A run's start on every rank: its one Communicator, set-up on rank 0 first, and each rank's device.

Every entry script that runs under mpiexec starts this way (``run.main``, ``eval.py``, ``sample.py``), so a
launcher that does not match the MPI, a bad ``FSDP_MPI_*`` setting or bad input ends every rank with one message
instead of leaving some waiting in a collective.
"""

import sys

import torch

from training.options import UsageError

from fsdp_mpi import Communicator
from fsdp_mpi.communication.failures.launcher import LauncherMismatchError


def communicator_for_the_run(prog: str) -> Communicator | None:
    """The run's one Communicator over all ranks, through which every collective of the experiments goes (logged,
    watched for hangs, checked in verify mode); None, with the error printed, under a launcher that does not match
    the MPI (N one-rank worlds would each write a run of their own) or with a bad FSDP_MPI_* setting."""
    try:
        return Communicator()
    except (LauncherMismatchError, ValueError) as failure:
        print(f"{prog}: error: {failure}", file=sys.stderr)
        return None


def set_up_rank_0_first(set_up, comm: Communicator) -> tuple[list | None, str | None]:
    """Runs ``set_up()`` (which returns its values and, last, an error message or None) on rank 0 first,
    which may download what is missing, then on the others only if it succeeded: every rank gets the
    same first error instead of some waiting for a rank that failed. Returns (the values, that error).

    ``set_up`` must make no collective: rank 0 runs it while the others wait here in a broadcast.
    """
    values = error = None
    if comm.rank == 0:
        *values, error = set_up()
    error = comm.broadcast_object(error, root=0)
    if error is None and comm.rank != 0:
        *values, error = set_up()
    errors = [e for e in comm.all_gather_object(error) if e]
    return values, (errors[0] if errors else None)


def pick_device(choice: str, local_rank: int) -> torch.device:
    """The device for --device `choice`: a rank on a GPU node takes the GPU of its node-local rank (``local_rank``,
    from ``strategies.node_placement``). No collective: rank 0 calls it alone in ``set_up_rank_0_first``."""
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device is visible")
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def allow_tf32(device: torch.device) -> None:
    """On a GPU, lets the matrix products that stay fp32 (all of a ``--precision 32`` run's; the fp32 parts of a
    mixed one) run on TF32 tensor cores: inputs rounded to 10 mantissa bits, sums in fp32, as nanoGPT and
    Lightning's advice do. The one place the experiments (training and ``bench.py``) choose it; ``eval.py``
    keeps true fp32, its baseline for bf16 and int8, and the tests never call this (torch's default is off)."""
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")


def announce_devices(device: torch.device, comm: Communicator) -> None:
    """Rank 0 prints every rank's device in one line when some rank is not on the CPU (every rank calls this):
    the first sign that a GPU job got past set-up, and of which rank took which GPU."""
    devices = comm.all_gather_object(str(device))
    if comm.rank == 0 and any(name != "cpu" for name in devices):
        print("devices: " + ", ".join(f"rank {rank} {name}" for rank, name in enumerate(devices)), flush=True)

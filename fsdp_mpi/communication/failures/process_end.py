"""How a rank's process ends on purpose after a loss: at once, without ``MPI_Finalize`` or ``MPI_Abort``,
either of which may wait forever once a rank of the job has died."""

import ctypes
import os
import sys

from mpi4py import MPI


def exit_without_finalize(code: int):
    """Ends this process with `code` at once, its output flushed, without ``MPI_Finalize`` or ``MPI_Abort``: after
    a lost rank, Open MPI 5.0.11's finalize now and then waits forever (a survivor hung there once in about twelve
    6-rank runs), and so does its launcher after an ``MPI_Abort`` (once in two 3-rank runs where a rank died as
    the job started); a ULFM job is content with processes that end without either, each survivor ending
    itself. Not so the job of a grow-back's newcomers (Open MPI 5.0.11's launcher reports such an end as an
    improper one, and ``mpirun`` fails): a newcomer first tells the launcher that it ends on purpose."""
    sys.stdout.flush()
    sys.stderr.flush()
    if MPI.Comm.Get_parent() != MPI.COMM_NULL:  # a newcomer (job.is_newcomer, which imports this module)
        _tell_the_launcher_this_process_ends()
    os._exit(code)


def _tell_the_launcher_this_process_ends() -> None:
    """``PMIx_Finalize``: the launcher's part of ``MPI_Finalize``, which ends nothing shared with the other ranks
    (so it cannot wait for a lost one). Nothing where the process has no PMIx library loaded."""
    with open("/proc/self/maps") as maps:
        library = next((line.split()[-1] for line in maps if "/libpmix.so" in line), None)
    if library is not None:
        ctypes.CDLL(library).PMIx_Finalize(None, ctypes.c_size_t(0))

"""Uneven data across ranks: stop every rank at the step where the first one runs out.

A rank with one batch more than the others enters that step's collectives
alone and waits for partners that have left the loop (the watchdog ends such a
job, but only after its timeout). Wrapping the loader makes the ranks agree,
before each step, that every one of them has a batch:

    for batch in even_batches(loader, model.comm):
        ...

The agreement costs one reduction of one number per step. The batches a rank
still had when another ran out are skipped, and rank 0 warns how many ranks that
concerned. To use every sample, give every rank the same number of batches
instead (pad the split, as ``torch.utils.data.DistributedSampler`` does).
"""

import warnings
from collections.abc import Iterable, Iterator

from fsdp_mpi.communication.comm import Communicator

_EXHAUSTED = object()  # what next() returns once this rank's batches are used up


def even_batches(batches: Iterable, comm=None) -> Iterator:
    """Yields `batches`' items while every rank of `comm` still has one; all ranks stop together.

    Args:
        batches: this rank's batches (a DataLoader, a list, a generator).
        comm: a ``fsdp_mpi.Communicator`` (e.g. ``model.comm``), an mpi4py communicator,
            or None for ``MPI.COMM_WORLD``.
    """
    comm = comm if isinstance(comm, Communicator) else Communicator(comm)
    iterator = iter(batches)
    taken = 0
    while True:
        batch = next(iterator, _EXHAUSTED)
        has_batch = batch is not _EXHAUSTED
        if comm.all_reduce_min_float(float(has_batch)) == 0.0:
            break
        taken += 1
        yield batch
    had_more = [rank for rank, more in enumerate(comm.all_gather_object(has_batch)) if more]
    if had_more and comm.rank == 0:
        warnings.warn(f"fsdp_mpi.loop.even_batches: a rank ran out of batches after {taken}; ranks {had_more} had more, "
                      f"which were skipped so that no rank waits for the others", stacklevel=2)


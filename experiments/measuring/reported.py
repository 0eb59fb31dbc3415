"""What a bench worker reports that bench.py's launcher reads, importable without fsdp_mpi: the launcher starts
the ranks and is not one, so it must not start MPI itself (some clusters' MPI expects every MPI process to
come from its launcher)."""

import statistics

# The parts of fsdp-mpi's step, in seconds (breakdown.py measures them and says what each holds).
PARTS = ("compute_s", "gradient_assembly_s", "hooks_own_s", "mpi_waiting_s", "mpi_moving_s")


def median_of_known(values) -> float | None:
    """The median of the values that were measured; None if none was (or there were none)."""
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None

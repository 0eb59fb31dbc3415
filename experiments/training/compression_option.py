"""``--comm-compression WEIGHTS[/GRADIENTS]``, read without fsdp_mpi: bench.py's launcher checks it before it
starts a rank, and a launcher must not start MPI itself (some clusters' MPI expects every MPI process to come
from its launcher)."""

FORMATS = ("none", "bf16", "int8")


def compression_formats(text: str) -> tuple[str | None, str | None]:
    """(the weights' format, the gradients' format) that `text` names, None for "none"; one format names both.
    Raises ValueError, naming the choices, for anything else."""
    formats = text.split("/")
    if len(formats) == 1:
        formats *= 2
    if len(formats) != 2 or not set(formats) <= set(FORMATS):
        raise ValueError(f"--comm-compression {text!r}: expected WEIGHTS or WEIGHTS/GRADIENTS, each one of "
                         f"{', '.join(FORMATS)} (e.g. int8/bf16)")
    weights, gradients = (None if name == "none" else name for name in formats)
    return weights, gradients

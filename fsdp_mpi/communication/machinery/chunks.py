"""How a collective is cut into pieces, in one place: by MPI's count limit, by the staging pipeline's chunk, by
the node transport's exchange, by the codecs' cache-sized columns. Each transport says how large a piece it
wants; this says where the pieces lie."""


def chunk_bounds(numel: int, chunk_numel: int) -> list[tuple[int, int]]:
    """[start, stop) of consecutive chunks of at most `chunk_numel` elements covering `numel` (one if 0)."""
    return [(start, min(start + chunk_numel, numel)) for start in range(0, max(numel, 1), chunk_numel)]


def elements_per_chunk(itemsize: int, chunk_bytes: int, rows: int = 1, max_elements: int | None = None) -> int:
    """Elements per row in a chunk of `chunk_bytes` holding `rows` rows of one itemsize, within `max_elements`
    (MPI's count limit) if given; at least one."""
    elements = chunk_bytes // (rows * itemsize)
    return max(1, elements if max_elements is None else min(elements, max_elements))

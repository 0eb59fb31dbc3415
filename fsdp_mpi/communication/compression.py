"""Compressed communication: weights gathered, and gradients reduced, in fewer bytes than fp32.

``Compression(weights="int8", gradients="bf16")`` says how each travels. It
changes the bytes on the wire only: the module still computes in fp32 (or in
``MixedPrecision.param_dtype``), and the master shards, the optimizer, state
dicts and checkpoints stay fp32, never the compressed copy.

A *codec* turns rows of floats into rows of bytes, and back::

    bf16   (R, k) float -> (R, 2k) bytes        each element rounded to bf16 (8 significant bits)
    int8   (R, k) float -> (R, 4 nb + k) bytes  nb = ceil(k / block_size) blocks per row, laid out as
                                                [ nb fp32 scales | k int8 codes ]; a block's scale is
                                                its absmax / 127, a code round(x / scale) in [-127, 127]

Blocks start at each row's first element, so a row (a rank's shard, or the
chunk of a gradient bound for one rank) is a whole number of blocks but for a
partial last one, which is quantized as if padded with zeros.

Three collectives use them, built from the communicator's bit-moving all-gather
and all-to-all (``comm.py`` still makes every MPI call):

    all-gather      each rank encodes its shard (S,) as one row; the rows are all-gathered and
                    decoded into the full buffer (W * S,) in the compute dtype
    reduce-scatter  each rank encodes its full gradient as W rows (row j: rank j's chunk of S);
                    an all-to-all sends row j to rank j; the W rows received are decoded and added
                    in fp32, in rank order (MPI cannot sum bf16 or int8-with-scales; a ring
                    reduce-scatter in 16 bits would round at every hop)
    all-reduce      (replicas) the reduce-scatter above on chunks of ceil(n / R), then each rank's
                    summed chunk encoded again and all-gathered: every replica decodes the same
                    bytes, so replicas stay bit-identical

The sum in rank order makes a reduction deterministic run to run and
independent of the order in which messages arrive. docs/communication.md
("Compressed communication") derives the error bounds and the bytes.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.machinery.chunks import chunk_bounds
from fsdp_mpi.communication.machinery.in_flight import InFlight
from fsdp_mpi.communication.machinery.sums import sum_in_rank_order

MODES = (None, "bf16", "int8")
INT8_LEVELS = 127  # codes in [-127, 127]: symmetric, so -x quantizes to -(code of x)
# Values a codec works on at once. Encoding and decoding take several passes (absmax, divide, round,
# scale, sum); over a chunk whose fp32 temporaries (1 MiB) stay in cache, only the first pass reads
# memory and only the last writes it. Over whole buffers instead, int8 took 135 ms to encode 30M values
# and 150 ms to decode and sum them on one core; chunked, 18 and 28 ms.
CHUNK_ELEMENTS = 2**18


@dataclass(frozen=True)
class Compression:
    """How gathered weights and reduced gradients travel (None: in the dtype they have, as without it).

    Args:
        weights: ``"bf16"`` or ``"int8"``: each rank's fp32 master shard is encoded so, gathered, and
            decoded into the compute dtype.
        gradients: ``"bf16"`` or ``"int8"``: the gradient reduction is an all-to-all of encoded chunks and a
            local fp32 sum (so is the replicas' all-reduce under HYBRID_SHARD and NO_SHARD).
        block_size: elements per int8 block, each with its own fp32 scale (4 bytes per block on the wire).
    """

    weights: str | None = None
    gradients: str | None = None
    block_size: int = 256

    def __post_init__(self):
        for field in ("weights", "gradients"):
            mode = getattr(self, field)
            if mode is not None and not isinstance(mode, str):
                raise TypeError(f"Compression.{field} must be None, 'bf16' or 'int8', got {mode!r}")
            if mode not in MODES:
                raise ValueError(f"Compression.{field}={mode!r} is not a mode: choose None, 'bf16' or 'int8'")
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int):
            raise TypeError(f"Compression.block_size must be an int, got {self.block_size!r}")
        if self.block_size < 1:
            raise ValueError(f"Compression.block_size={self.block_size}: a block holds at least one element")

    @property
    def weight_codec(self) -> "Codec | None":
        return codec(self.weights, self.block_size)

    @property
    def gradient_codec(self) -> "Codec | None":
        return codec(self.gradients, self.block_size)


# ----------------------------------------------------------------- formats


def quantize_int8(rows: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block symmetric absmax quantization.

    Args:
        rows: (R, k) floats; each row is cut into nb = ceil(k / block_size) blocks from its start.
    Returns:
        codes (R, k) int8 = round(x / scale), and scales (R, nb) fp32 = absmax of each block / 127
        (0 for a block of zeros, whose codes are 0). A non-finite value makes its block decode non-finite.
    """
    count, numel = rows.shape
    blocks_per_row = -(-numel // block_size)
    padding = blocks_per_row * block_size - numel
    values = rows.float()
    if padding:  # a partial last block: zeros change no absmax and decode to nothing kept
        values = F.pad(values, (0, padding))
    blocks = values.reshape(count, blocks_per_row, block_size)  # (R, nb, block_size)
    # Every temporary costs a pass: the absmax from two reductions, not abs(); one quotient, rounded and
    # clamped in place. (The codecs call this a chunk of columns at a time, so those passes stay in cache.)
    scales = torch.maximum(blocks.amax(dim=-1), blocks.amin(dim=-1).neg_()) / INT8_LEVELS  # (R, nb)
    divisors = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)  # (R, nb, 1)
    codes = (blocks / divisors).round_().clamp_(-INT8_LEVELS, INT8_LEVELS).to(torch.int8)
    return codes.view(count, -1)[:, :numel], scales


def dequantize_int8(codes: torch.Tensor, scales: torch.Tensor, block_size: int) -> torch.Tensor:
    """codes (R, k) int8, scales (R, nb) fp32 -> (R, k) fp32 values = code * its block's scale."""
    count, numel = codes.shape
    blocks_per_row = scales.shape[1]
    values = codes.float()
    if blocks_per_row * block_size != numel:
        values = F.pad(values, (0, blocks_per_row * block_size - numel))
    blocks = values.reshape(count, blocks_per_row, block_size).mul_(scales.unsqueeze(-1))  # (R, nb, block_size)
    return blocks.view(count, -1)[:, :numel]


def column_chunks(count: int, numel: int, multiple: int = 1) -> list[tuple[int, int]]:
    """Column ranges [start, stop) of rows (count, numel), about CHUNK_ELEMENTS values each, every start a
    multiple of `multiple` (an int8 block never straddles two chunks)."""
    return chunk_bounds(numel, max(multiple, CHUNK_ELEMENTS // count // multiple * multiple)) if numel else []


class ChunkedDecoding:
    """What both codecs do with a wire of R rows, a chunk of columns at a time (``decode_columns``), so that
    the decoded fp32 values exist only chunk by chunk: decode them into a buffer, or sum them in rank order."""

    column_multiple = 1  # chunks start at multiples of this

    def decode(self, wire: torch.Tensor, numel: int) -> torch.Tensor:
        """(R, wire_bytes(k)) uint8 -> (R, k) fp32."""
        rows = torch.empty(wire.shape[0], numel, dtype=torch.float32, device=wire.device)
        self.decode_into(rows, wire)
        return rows

    def decode_into(self, rows: torch.Tensor, wire: torch.Tensor) -> None:
        """rows (R, k), any float dtype <- the values `wire` encodes."""
        count, numel = rows.shape
        for start, stop in column_chunks(count, numel, self.column_multiple):
            rows[:, start:stop] = self.decode_columns(wire, numel, start, stop)

    def decode_sum_into(self, total: torch.Tensor, wire: torch.Tensor) -> None:
        """total (k,) <- the sum of the rows `wire` encodes, added in fp32 in rank order (``machinery/sums.py``)."""
        numel = total.numel()
        for start, stop in column_chunks(wire.shape[0], numel, self.column_multiple):
            sum_in_rank_order(list(self.decode_columns(wire, numel, start, stop)), total[start:stop])


class BFloat16Codec(ChunkedDecoding):
    """Each element as bf16: 2 bytes, relative error at most 2^-8 (bf16's unit roundoff)."""

    def wire_bytes(self, numel: int) -> int:
        return 2 * numel

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """(R, k) float -> (R, 2k) uint8."""
        return rows.to(torch.bfloat16).contiguous().view(torch.uint8)

    def decode_columns(self, wire: torch.Tensor, numel: int, start: int, stop: int) -> torch.Tensor:
        """Columns [start, stop) of the rows of (R, 2k) uint8, as (R, stop - start) fp32."""
        return wire.view(torch.bfloat16)[:, start:stop].float()


class Int8BlockCodec(ChunkedDecoding):
    """Int8 codes with one fp32 scale per block: k + 4 ceil(k / block_size) bytes per row of k elements;
    error at most half a step (absmax of the block / 254) per element, plus fp32 rounding."""

    def __init__(self, block_size: int):
        self.block_size = self.column_multiple = block_size

    def blocks(self, numel: int) -> int:
        return -(-numel // self.block_size)

    def wire_bytes(self, numel: int) -> int:
        return 4 * self.blocks(numel) + numel

    def encode(self, rows: torch.Tensor) -> torch.Tensor:
        """(R, k) float -> (R, 4 nb + k) uint8: each row's scales, then its codes."""
        count, numel = rows.shape
        wire = torch.empty(count, self.wire_bytes(numel), dtype=torch.uint8, device=rows.device)
        scale_bytes = 4 * self.blocks(numel)
        for start, stop in column_chunks(count, numel, self.block_size):
            codes, scales = quantize_int8(rows[:, start:stop], self.block_size)
            first_block = start // self.block_size
            wire[:, 4 * first_block:4 * (first_block + scales.shape[1])] = scales.view(torch.uint8)
            wire[:, scale_bytes + start:scale_bytes + stop] = codes.view(torch.uint8)
        return wire

    def decode_columns(self, wire: torch.Tensor, numel: int, start: int, stop: int) -> torch.Tensor:
        """Columns [start, stop) of the rows of (R, 4 nb + k) uint8, `start` a block's first element:
        (R, stop - start) fp32."""
        first_block, end_block = start // self.block_size, self.blocks(stop)
        scales = wire[:, 4 * first_block:4 * end_block].contiguous().view(torch.float32)  # copied to be 4-byte aligned
        scale_bytes = 4 * self.blocks(numel)
        return dequantize_int8(wire[:, scale_bytes + start:scale_bytes + stop].view(torch.int8), scales,
                               self.block_size)


Codec = BFloat16Codec | Int8BlockCodec


def codec(mode: str | None, block_size: int) -> Codec | None:
    """The codec of a ``Compression`` mode (None: uncompressed)."""
    if mode is None:
        return None
    return BFloat16Codec() if mode == "bf16" else Int8BlockCodec(block_size)


# ----------------------------------------------------------------- collectives


def start_compressed_all_gather(comm: Communicator, full: torch.Tensor, shard: torch.Tensor, codec: Codec,
                                unit: str = "") -> InFlight:
    """full (W * S,), any float dtype <- every rank's shard (S,), carried by `codec`: the encoded all-gather is
    started (a prefetch), and ``wait()`` completes it and decodes."""
    wire = codec.encode(shard.view(1, -1)).view(-1)  # (wire_bytes(S),)
    gathered = torch.empty(comm.world_size * wire.numel(), dtype=torch.uint8, device=shard.device)
    in_flight = comm.start_all_gather_into(gathered, wire, unit)
    return in_flight.then(lambda: codec.decode_into(full.view(comm.world_size, -1), gathered.view(comm.world_size, -1)))


def compressed_all_gather(comm: Communicator, full: torch.Tensor, shard: torch.Tensor, codec: Codec,
                          unit: str = "") -> None:
    """full (W * S,) <- every rank's shard (S,), in rank order, each encoded by `codec` and decoded."""
    wire = codec.encode(shard.view(1, -1)).view(-1)
    gathered = torch.empty(comm.world_size * wire.numel(), dtype=torch.uint8, device=shard.device)
    comm.all_gather_into(gathered, wire, unit)
    codec.decode_into(full.view(comm.world_size, -1), gathered.view(comm.world_size, -1))


def compressed_reduce_scatter_sum(comm: Communicator, shard: torch.Tensor, full: torch.Tensor, codec: Codec,
                                  unit: str = "") -> None:
    """shard (S,) <- sum over ranks of their full[rank * S:(rank + 1) * S], each encoded by `codec`,
    decoded here and added in fp32 in rank order."""
    wire = codec.encode(full.view(comm.world_size, -1))  # (W, b): row j is rank j's chunk
    received = torch.empty_like(wire)  # row i: rank i's encoding of this rank's chunk
    comm.all_to_all(received.view(-1), wire.view(-1), unit)
    codec.decode_sum_into(shard, received)


def compressed_all_reduce_sum_(comm: Communicator, tensor: torch.Tensor, codec: Codec, unit: str = "") -> None:
    """tensor (n,) <- its sum over ranks, in place: a compressed reduce-scatter of chunks of ceil(n / W), then
    a compressed all-gather of the summed chunks, which every rank decodes alike. One rank: unchanged."""
    world_size = comm.world_size
    if world_size == 1:  # one rank: encoding would round values that go nowhere
        return
    chunk_numel = -(-tensor.numel() // world_size)
    padded = F.pad(tensor.float(), (0, world_size * chunk_numel - tensor.numel()))  # (W * chunk,)
    summed_chunk = torch.empty(chunk_numel, dtype=torch.float32, device=tensor.device)
    compressed_reduce_scatter_sum(comm, summed_chunk, padded, codec, unit)
    compressed_all_gather(comm, padded, summed_chunk, codec, unit)
    tensor.copy_(padded[:tensor.numel()])

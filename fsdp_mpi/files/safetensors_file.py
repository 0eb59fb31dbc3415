"""Writing safetensors files tensor by tensor, so that neither a shard nor a model is ever copied whole.

The format is an 8-byte little-endian header length, a JSON header giving each
tensor's dtype, shape and byte range, then the raw bytes. Since the header needs
only shapes, a file can be written while its tensors are still being gathered,
one at a time. (``safetensors.torch.save_file`` needs every tensor at once and
refuses views that share storage, which a rank's parameter views all do.)
Reading uses the ``safetensors`` package, whose ``get_slice`` reads only the
requested rows.
"""

import hashlib
import json
import os
from pathlib import Path

import torch

_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
           torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
           torch.bool: "BOOL"}


class SafetensorsWriter:
    """Writes the tensors announced in `layout` ([(name, dtype, shape)]), in that order, then ``close()``."""

    def __init__(self, path: Path, layout: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        for name, dtype, shape in layout:
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
            offset += nbytes
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        self.path, self._expected = path, [(name, dtype, tuple(shape)) for name, dtype, shape in layout]
        self._file = open(path, "wb")
        self._digest = hashlib.sha256()
        self._put(len(encoded).to_bytes(8, "little"))
        self._put(encoded)

    def write(self, tensor: torch.Tensor) -> None:
        name, dtype, shape = self._expected.pop(0)
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{self.path}: {name} announced as {dtype} {shape}, got {tensor.dtype} {tuple(tensor.shape)}")
        self._put(tensor.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy())

    def close(self) -> dict:
        """Flushes to disk; returns the file's size in bytes and sha256."""
        if self._expected:
            raise ValueError(f"{self.path}: closed before {self._expected[0][0]} was written")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        return {"bytes": self.path.stat().st_size, "sha256": self._digest.hexdigest()}

    def _put(self, data) -> None:
        self._file.write(data)
        self._digest.update(data)


def write_safetensors(path: Path, tensors: dict[str, torch.Tensor]) -> dict:
    """Writes `tensors` to `path` (no copies beyond one tensor at a time); returns size and sha256."""
    writer = SafetensorsWriter(path, [(name, t.dtype, tuple(t.shape)) for name, t in tensors.items()])
    for tensor in tensors.values():
        writer.write(tensor)
    return writer.close()

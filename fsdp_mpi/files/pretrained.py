"""Hugging Face's checkpoint layout, read straight into shards and written one unit at a time.

``load_pretrained`` fills a wrapped model from a published checkpoint (one
``.safetensors`` file, or a directory with ``model.safetensors`` or an indexed
set ``model.safetensors.index.json``). Each rank opens the files lazily and reads
only the rows that cover the element ranges its shards keep, so no process ever
holds the whole model (a model built on the meta device never exists in full).

``export_pretrained`` writes the full model in that layout: the files are
planned from the parameters' shapes, so each can be written while its tensors
are gathered, one handle at a time; rank 0 holds one unit's parameters at a
time, never the model. Tied weights are written once (loaders re-tie them).

Both take ``rows``: parameters whose file holds only their first rows, such as
a vocabulary padded in memory to a multiple of 64 (``models/vocabulary.py``,
whose models give it as ``model.checkpoint_rows()``). The rows after them are
zero when loaded and left out when exported. A tensor's first rows are the
first elements of its flat layout, so this changes only where a range ends.
"""

import itertools
import json
import os
from pathlib import Path

import torch
from torch import nn

from fsdp_mpi.files.safetensors_file import SafetensorsWriter
from fsdp_mpi.sharding.state_dict import model_comm, persistent_buffers, sharded_parameters

SINGLE_FILE = "model.safetensors"
INDEX = "model.safetensors.index.json"


class PretrainedError(ValueError):
    """A checkpoint that cannot be read, or that does not fit the model."""


# ----------------------------------------------------------------- loading into shards

def load_pretrained(model: nn.Module, path: str | os.PathLike, key_map=None, may_be_missing: tuple[str, ...] = (),
                    rows: dict[str, int] | None = None):
    """Copies a safetensors checkpoint into `model`'s shards, each rank reading only what it keeps.

    Args:
        model: a FullyShardedDataParallel model (possibly initialised on meta).
        path: a ``.safetensors`` file or a directory holding ``model.safetensors`` or ``model.safetensors.index.json``.
        key_map: maps a checkpoint key to the model's name for it, or to None to skip it
            (e.g. ``fsdp_mpi_models.gpt2.checkpoint_key_to_name``); identity by default.
        may_be_missing: name prefixes that may be absent (a fresh task head keeps its initial values).
        rows: parameter name -> how many of its first rows the checkpoint holds (the rest are set to zero).

    Every rank must call it. Raises PretrainedError naming every missing,
    unexpected or mis-shaped tensor before changing anything.
    """
    sources = _checkpoint_tensors(Path(path), key_map or (lambda key: key))
    params = sharded_parameters(model)
    buffers = dict(persistent_buffers(model))
    problems, chosen = [], []
    for param in params:
        found = [name for name in param.names if name in sources]
        if not found:
            if not any(name.startswith(may_be_missing) for name in param.names):
                problems.append("missing: " + " or ".join(param.names))
            continue
        shape = sources[found[0]][2]
        if tuple(shape) != _stored_shape(param, rows):
            problems.append(f"mis-shaped: {found[0]}: checkpoint {tuple(shape)}, model {_stored_shape(param, rows)}")
        chosen.append((param, sources[found[0]]))
    known = {name for param in params for name in param.names} | set(buffers)
    if unexpected := sorted(set(sources) - known):
        problems.append("unexpected: " + ", ".join(unexpected))
    if problems:
        raise PretrainedError(f"{path} does not fit {type(model).__name__}: " + " | ".join(problems))
    with torch.no_grad():
        for param, (file, key, shape) in chosen:
            start, stop = param.handle.part_held(param.slot)
            stored = min(stop, max(start, torch.Size(shape).numel()))  # (elements past the stored rows: zero)
            param.view[:stored - start].copy_(_read_range(file, key, shape, start, stored))
            param.view[stored - start:].zero_()
        for name, buffer in buffers.items():
            if name in sources:
                file, key, _ = sources[name]
                buffer.copy_(file.get_tensor(key))


def _stored_shape(param, rows: dict[str, int] | None) -> tuple[int, ...]:
    """The shape `param` has in a checkpoint: its own, or its first rows only if `rows` names it."""
    shape = tuple(param.slot.shape)
    kept = next((rows[name] for name in param.names if rows and name in rows), None)
    return shape if kept is None else (kept, *shape[1:])


def _checkpoint_tensors(path: Path, key_map) -> dict:
    """The model's name -> (open safetensors file, checkpoint key, shape), for every tensor `key_map` keeps."""
    from safetensors import SafetensorError, safe_open

    if path.is_dir():
        if (path / INDEX).exists():
            files = sorted(set(json.loads((path / INDEX).read_text())["weight_map"].values()))
        elif (path / SINGLE_FILE).exists():
            files = [SINGLE_FILE]
        else:
            raise PretrainedError(f"{path}: contains neither {SINGLE_FILE} nor {INDEX}")
        paths = [path / name for name in files]
    elif path.suffix == ".safetensors" and path.exists():
        paths = [path]
    else:
        raise PretrainedError(f"{path}: expected a .safetensors file or a directory holding one")
    sources = {}
    for file_path in paths:
        try:
            file = safe_open(str(file_path), framework="pt")
        except (SafetensorError, OSError) as error:
            raise PretrainedError(f"{file_path}: not a readable safetensors file ({error})") from error
        for key in file.keys():
            name = key_map(key)
            if name is not None:
                sources[name] = (file, key, file.get_slice(key).get_shape())
    return sources


def _read_range(file, key: str, shape: list[int], start: int, stop: int) -> torch.Tensor:
    """Elements [start, stop) of the flattened tensor `key`, reading only the rows that hold them."""
    if start == stop:
        return torch.empty(0)
    if len(shape) <= 1:
        return file.get_slice(key)[start:stop].reshape(-1)
    row = torch.Size(shape[1:]).numel()
    first, last = start // row, -(-stop // row)
    rows = file.get_slice(key)[first:last].reshape(-1)  # at most two rows more than asked for
    return rows[start - first * row:stop - first * row]


# ----------------------------------------------------------------- exporting, streamed

def export_pretrained(model: nn.Module, directory: str | os.PathLike, config: dict | None = None,
                      max_file_bytes: int = 2 * 1024**3, rows: dict[str, int] | None = None) -> Path:
    """Writes `model` in Hugging Face's layout: safetensors files of at most `max_file_bytes` of tensors, and their index.

    One file is named ``model.safetensors``; several are ``model-00001-of-0000K.safetensors``
    with ``model.safetensors.index.json``. `config` (a Hugging Face ``config.json``
    as a dict) is written too. `rows` (parameter name -> rows) writes only those first rows of a
    parameter. Every rank must call it; rank 0 writes.
    """
    directory = Path(directory)
    params = sharded_parameters(model)
    comm = model_comm(model)
    writing = comm.rank == 0
    buffers = list(persistent_buffers(model))
    # Plan the files from shapes: tensors in gathering order, each tied weight once under its first name.
    layout = [(p.names[0], p.view.dtype, _stored_shape(p, rows)) for p in params]
    layout += [(name, buffer.dtype, tuple(buffer.shape)) for name, buffer in buffers]
    file_of = _plan_files(layout, max_file_bytes)
    if writing:
        directory.mkdir(parents=True, exist_ok=True)
    writer = None

    def write(name: str, tensor: torch.Tensor) -> None:
        nonlocal writer
        if writer is None or writer.path.name != file_of[name]:
            if writer is not None:
                writer.close()
            writer = SafetensorsWriter(directory / file_of[name], [e for e in layout if file_of[e[0]] == file_of[name]])
        writer.write(tensor)

    for handle, group in itertools.groupby(params, key=lambda p: p.handle):
        full = handle.gather_masters()  # (padded_numel,): every rank takes part, one handle at a time
        if writing:
            for param, tensor in zip(group, handle.split_full(full)):
                write(param.names[0], tensor[:_stored_shape(param, rows)[0]] if tensor.dim() else tensor)
        del full
    if writing:
        for name, buffer in buffers:
            write(name, buffer)
        writer.close()
        if len(set(file_of.values())) > 1:
            total = sum(torch.Size(shape).numel() * dtype.itemsize for _, dtype, shape in layout)
            index = {"metadata": {"total_size": total}, "weight_map": file_of}
            (directory / INDEX).write_text(json.dumps(index, indent=2) + "\n")
        if config is not None:
            (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    comm.barrier()  # no rank returns before the files are complete
    return directory


def _plan_files(layout: list, max_file_bytes: int) -> dict[str, str]:
    """Tensor name -> file name, filling files in order up to `max_file_bytes` (a larger tensor gets its own)."""
    assignment, used, count = {}, 0, 0
    for name, dtype, shape in layout:
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        if count == 0 or (used + nbytes > max_file_bytes and used > 0):
            count, used = count + 1, 0
        used += nbytes
        assignment[name] = count
    if count == 1:
        return {name: SINGLE_FILE for name in assignment}
    return {name: f"model-{n:05d}-of-{count:05d}.safetensors" for name, n in assignment.items()}

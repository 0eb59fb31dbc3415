"""Sharded checkpoints: every rank writes its part, and any number of ranks reads them back.

    directory/
        rank-00000.safetensors   rank r's part of each parameter ("param/<name>", 1-D) and of
        rank-00001.safetensors   each per-element optimizer state ("optim/<name>/<key>")
        state.pt                 rank 0: buffers, optimizer groups and scalar state (Adam's step), `extra`,
                                 and every rank's random generator states
        index.json               written last: format version, world size, each parameter's shape,
                                 dtype and the element range [start, stop) of it in each rank's file,
                                 each file's size and sha256

A parameter is stored under its original name by element ranges of its
flattened values, not as the padded flat buffer: padding never reaches a file,
and a rank that loads needs only the ranges it will hold, so a checkpoint saved
on N ranks loads on M (reading the overlapping pieces of up to a few files),
with another wrap policy, or in one process (``consolidate_checkpoint``).

Saving never damages the previous checkpoint: everything is written into
``<directory>.tmp`` and renamed into place once every rank has finished (an old
checkpoint is moved aside first and removed last). A rank killed mid-save
leaves only the ``.tmp`` directory behind. Loading checks every file it reads
against the index's size and sha256 and names the file that is missing,
truncated or corrupted; it checks names and shapes before changing anything.
Errors on any rank are raised on every rank, so no rank is left waiting.

Resuming on the world size that saved restores each rank's random generator
states (torch's CPU and CUDA generators, Python's ``random``), so dropout draws
the same masks and the run continues bit for bit. On another world size the
generators are left as they are: that run continues statistically, not bitwise.
"""

import json
import os
import random
from pathlib import Path

import torch
from torch import nn

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.files.durable import file_info, prepare_empty, replace_directory, sha256, write_durably
from fsdp_mpi.files.optimizer_state import OptimizerStateError, split_optimizer_state, state_for_views
from fsdp_mpi.files.safetensors_file import write_safetensors
from fsdp_mpi.sharding.state_dict import ShardedParameter, model_comm, persistent_buffers, sharded_parameters

FORMAT = "fsdp_mpi-sharded-checkpoint"
VERSION = 1
INDEX = "index.json"
STATE = "state.pt"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read, or that does not fit the model."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


# ----------------------------------------------------------------- saving

def save_checkpoint(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    extra=None) -> Path:
    """Writes `model`'s shards (and `optimizer`'s state, and `extra`) to `directory`, replacing what is there.

    Every rank must call it. `extra` holds what the caller needs to resume (step,
    RNG states, scheduler state, data position): tensors, numbers, strings, and
    lists, tuples and dicts of them.
    """
    directory = Path(directory)
    params = sharded_parameters(model)
    comm = model_comm(model)
    # Under HYBRID_SHARD and NO_SHARD, ranks in other replicas of a shard hold the same elements: only the
    # first replica writes them (the others write an empty file, and their RNG states like every rank).
    replicas = params[0].handle.replicas
    writes_elements = replicas is None or replicas.rank == 0
    temporary = directory.with_name(directory.name + ".tmp")
    on_every_rank(comm, lambda: prepare_empty(temporary) if comm.rank == 0 else None)

    tensors = {f"param/{p.names[0]}": p.view.detach() for p in params}
    optimizer_state = None
    if optimizer is not None:
        per_element, optimizer_state = on_every_rank(comm, lambda: split_optimizer_state(optimizer, params))
        tensors.update(per_element)
    written = comm.all_gather_object(on_every_rank(
        comm, lambda: write_safetensors(temporary / rank_file(comm.rank), tensors if writes_elements else {})))
    scalar_states = comm.all_gather_object(optimizer_state and optimizer_state["scalars"])
    rng_states = comm.all_gather_object(_rng_states())
    # Which element range of each parameter every rank holds: [[rank, start, stop], ...], non-empty ones.
    held = comm.all_gather_object([p.handle.part_held(p.slot) for p in params] if writes_elements else None)
    pieces = [[[rank, *held[rank][i]] for rank in range(comm.world_size)
               if held[rank] is not None and held[rank][i][1] > held[rank][i][0]] for i in range(len(params))]

    def finish_on_rank_0():
        state = {"buffers": {name: b.detach().cpu() for name, b in persistent_buffers(model)}, "extra": extra,
                 "rng": rng_states}
        if optimizer_state is not None:
            merged = {}
            for scalars in scalar_states:  # a rank holding no element of a parameter may have no state for it
                for name, values in scalars.items():
                    merged.setdefault(name, values)
            state["optimizer"] = {"param_groups": optimizer_state["param_groups"], "scalars": merged}
        torch.save(state, temporary / STATE)
        files = {rank_file(rank): info for rank, info in enumerate(written)}
        files[STATE] = file_info(temporary / STATE)
        index = {
            "format": FORMAT, "version": VERSION, "world_size": comm.world_size, "files": files,
            "parameters": {p.names[0]: {"aliases": list(p.names[1:]), "shape": list(p.slot.shape),
                                        "dtype": str(p.view.dtype).removeprefix("torch."),
                                        "pieces": pieces[i]} for i, p in enumerate(params)},
            "optimizer_keys": optimizer_state and optimizer_state["keys"],
        }
        write_durably(temporary / INDEX, json.dumps(index, indent=1).encode())
        replace_directory(temporary, directory)
    on_every_rank(comm, lambda: finish_on_rank_0() if comm.rank == 0 else None)
    return directory


# ----------------------------------------------------------------- loading

def load_checkpoint(directory: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    restore_rng: bool = True):
    """Loads a checkpoint saved on any number of ranks into `model` (and `optimizer`); returns its `extra`.

    Every rank must call it, with the model wrapped as it will train (and the
    optimizer built from ``model.parameters()``, with the same parameter groups as
    when saving). Nothing changes unless every name and shape fits. With
    `restore_rng`, on the world size that saved, each rank's generators continue
    where they were.
    """
    params = sharded_parameters(model)
    comm = model_comm(model)
    reader = on_every_rank(comm, lambda: CheckpointReader(directory))
    on_every_rank(comm, lambda: reader.check_fits(params, optimizer is not None))
    # Read everything first, so that a bad file changes nothing.
    values = on_every_rank(comm, lambda: [reader.read(p.names[0], *p.handle.part_held(p.slot)) for p in params])
    state = on_every_rank(comm, lambda: reader.state())
    optimizer_state = None
    if optimizer is not None:
        optimizer_state = on_every_rank(comm, lambda: _state_for_views(reader, optimizer, params, state))
    with torch.no_grad():
        for param, value in zip(params, values):
            param.view.copy_(value)
        buffers = dict(persistent_buffers(model))
        for name, value in state["buffers"].items():
            buffers[name].copy_(value)
    if optimizer_state is not None:
        optimizer.load_state_dict(optimizer_state)
    if restore_rng and reader.index["world_size"] == comm.world_size:
        _set_rng_states(state["rng"][comm.rank])
    return state["extra"]


def _rng_states() -> dict:
    states = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict) -> None:
    torch.set_rng_state(states["torch"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def _state_for_views(reader: "CheckpointReader", optimizer, params: list[ShardedParameter], state: dict) -> dict:
    """The optimizer's ``state_dict()`` for this rank's views, read from the checkpoint by name."""
    saved = state.get("optimizer")
    if saved is None:
        raise CheckpointError(f"{reader.directory}: holds no optimizer state")
    return state_for_views(optimizer, params, {**saved, "keys": reader.index["optimizer_keys"]},
                           lambda name, start, stop, key: reader.read(name, start, stop, state_key=key))


class CheckpointReader:
    """Reads element ranges of a checkpoint's tensors, checking each file before its first use."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index_path = self.directory / INDEX
        if not index_path.exists():
            interrupted = self.directory.with_name(self.directory.name + ".tmp").exists()
            raise CheckpointError(f"{index_path}: no such file; {self.directory} is not a complete sharded checkpoint"
                                  + (" (a save into it was interrupted)" if interrupted else ""))
        try:
            self.index = json.loads(index_path.read_text())
        except (OSError, ValueError) as error:
            raise CheckpointError(f"{index_path}: unreadable ({error})") from error
        if self.index.get("format") != FORMAT or self.index.get("version") != VERSION:
            raise CheckpointError(f"{index_path}: not a version-{VERSION} {FORMAT} index")
        self._open = {}

    def check_fits(self, params: list[ShardedParameter], with_optimizer: bool) -> None:
        """Raises CheckpointError naming every missing, unexpected or mis-shaped parameter."""
        saved = {}
        for name, entry in self.index["parameters"].items():
            for alias in [name, *entry["aliases"]]:
                saved[alias] = entry
        ours = {name: p for p in params for name in p.names}
        problems = []
        if missing := sorted(set(ours) - set(saved)):
            problems.append("missing from the checkpoint: " + _listing(missing))
        if unexpected := sorted(set(saved) - set(ours)):
            problems.append("not in the model: " + _listing(unexpected))
        for name in sorted(set(ours) & set(saved)):
            shape, dtype = list(ours[name].slot.shape), str(ours[name].view.dtype).removeprefix("torch.")
            if saved[name]["shape"] != shape or saved[name]["dtype"] != dtype:
                problems.append(f"{name}: checkpoint {saved[name]['dtype']} {saved[name]['shape']}, "
                                f"model {dtype} {shape}")
        if problems:
            raise CheckpointError(f"{self.directory} does not fit this model: " + " | ".join(problems))
        if with_optimizer and self.index["optimizer_keys"] is None:
            raise CheckpointError(f"{self.directory}: holds no optimizer state")

    def read(self, parameter: str, start: int, stop: int, state_key: str | None = None) -> torch.Tensor:
        """Elements [start, stop) of a flattened parameter (or of its optimizer state `state_key`), 1-D.

        They come from whichever rank files hold them: one file when loading on the
        world size that saved, a few when resharding.
        """
        key = f"param/{parameter}" if state_key is None else f"optim/{parameter}/{state_key}"
        entry = self.index["parameters"][parameter]
        parts = []
        for rank, piece_start, piece_stop in entry["pieces"]:
            lo, hi = max(start, piece_start), min(stop, piece_stop)
            if lo < hi:
                parts.append(self._file(rank_file(rank)).get_slice(key)[lo - piece_start:hi - piece_start])
        dtype = getattr(torch, entry["dtype"])
        return torch.cat(parts) if parts else torch.empty(0, dtype=dtype)

    def state(self) -> dict:
        """state.pt: buffers, optimizer groups and scalars, and the caller's `extra`."""
        path = self._checked(STATE)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # torch raises many types for damaged files
            raise CheckpointError(f"{path}: unreadable ({error})") from error

    def _file(self, name: str):
        if name not in self._open:
            from safetensors import safe_open
            self._open[name] = safe_open(str(self._checked(name)), framework="pt")
        return self._open[name]

    def _checked(self, name: str) -> Path:
        path = self.directory / name
        expected = self.index["files"].get(name)
        if expected is None or not path.exists():
            raise CheckpointError(f"{path}: missing from the checkpoint")
        if path.stat().st_size != expected["bytes"]:
            raise CheckpointError(f"{path}: {path.stat().st_size} bytes, the index says {expected['bytes']} "
                                  "(truncated or replaced)")
        if sha256(path) != expected["sha256"]:
            raise CheckpointError(f"{path}: contents differ from the index's sha256 (corrupted)")
        return path


def consolidate_checkpoint(directory: str | os.PathLike) -> dict:
    """The whole checkpoint in one process, without MPI: ``{"model", "optimizer", "extra"}``.

    "model" is the full state dict (every name, tied ones too, and buffers);
    "optimizer" maps each parameter name to its full state, plus "param_groups".
    """
    reader = CheckpointReader(directory)
    state = reader.state()
    model, optimizer = dict(state["buffers"]), None
    for name, entry in reader.index["parameters"].items():
        full = reader.read(name, 0, torch.Size(entry["shape"]).numel()).view(entry["shape"])
        for alias in [name, *entry["aliases"]]:
            model[alias] = full
    if "optimizer" in state:
        optimizer = {"param_groups": state["optimizer"]["param_groups"], "state": {}}
        for name, entry in reader.index["parameters"].items():
            keys = reader.index["optimizer_keys"].get(name, [])
            per_element = {key: reader.read(name, 0, torch.Size(entry["shape"]).numel(), state_key=key).view(entry["shape"])
                           for key in keys}
            if per_element or name in state["optimizer"]["scalars"]:
                optimizer["state"][name] = {**state["optimizer"]["scalars"].get(name, {}), **per_element}
    return {"model": model, "optimizer": optimizer, "extra": state["extra"]}


def _listing(names: list[str], most: int = 8) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def on_every_rank(comm: Communicator, work):
    """Runs `work` on this rank; if it fails on any rank, raises CheckpointError on every rank, naming each failure.

    Checkpoint errors (a full disk, a corrupted file) often happen on one rank
    only; raising there alone would leave the others waiting in the next collective.
    """
    try:
        result, failure = work(), None
    except (CheckpointError, OptimizerStateError, OSError) as error:
        result, failure = None, str(error)
    ranks_by_failure = {}
    for rank, text in enumerate(comm.all_gather_object(failure)):
        if text is not None:
            ranks_by_failure.setdefault(text, []).append(str(rank))
    if ranks_by_failure:
        raise CheckpointError("; ".join(f"rank {', '.join(ranks)}: {text}" for text, ranks in ranks_by_failure.items()))
    return result

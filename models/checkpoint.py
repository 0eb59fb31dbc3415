"""Reading and writing checkpoints in Hugging Face's layout (safetensors or PyTorch .bin files).

Published GPT-2 and BERT checkpoints differ in small ways from the current
``state_dict()`` of their models: keys without the base-model prefix
(``h.0.attn...`` instead of ``transformer.h.0.attn...``), TensorFlow-era
``gamma``/``beta`` names, saved attention-mask buffers, and tied weights stored
once. Each model passes a ``normalize_key`` that maps a checkpoint key to one of
its own (or ``None`` to ignore it); everything else is checked here. A model
whose vocabulary is padded in memory (``models/vocabulary.py``) also passes its
``checkpoint_rows()``: the checkpoint holds only those first rows of the tensor.
"""

import json
from pathlib import Path

import torch
from torch import nn

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SHARDED_INDEX = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


class PretrainedCheckpointError(ValueError):
    """A Hugging Face checkpoint that cannot be read, or does not fit the model, in ``from_pretrained``. (fsdp_mpi
    raises PretrainedError when ``load_pretrained`` reads one into shards, CheckpointError for its own format.)"""


def _read_weight_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors import SafetensorError
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except (SafetensorError, OSError) as error:
            raise PretrainedCheckpointError(f"{path}: not a readable safetensors file ({error})") from error
    if path.suffix in (".bin", ".pt", ".pth"):
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # torch raises many types for corrupt files
            raise PretrainedCheckpointError(f"{path}: not a readable PyTorch checkpoint ({error})") from error
    raise PretrainedCheckpointError(f"{path}: expected a .safetensors or .bin file")


def read_checkpoint(path: str | Path) -> tuple[dict[str, torch.Tensor], dict | None]:
    """Reads the tensors of a checkpoint file or directory, and its config.json if there is one."""
    path = Path(path)
    if not path.exists():
        raise PretrainedCheckpointError(f"{path}: no such file or directory")
    config = None
    if path.is_dir():
        if (path / CONFIG_FILE).exists():
            config = json.loads((path / CONFIG_FILE).read_text())
        if (path / SHARDED_INDEX).exists():
            shard_names = sorted(set(json.loads((path / SHARDED_INDEX).read_text())["weight_map"].values()))
            tensors = {}
            for name in shard_names:
                tensors.update(_read_weight_file(path / name))
            return tensors, config
        for name in WEIGHT_FILES:
            if (path / name).exists():
                return _read_weight_file(path / name), config
        raise PretrainedCheckpointError(f"{path}: contains none of {', '.join(WEIGHT_FILES)}")
    return _read_weight_file(path), config


def load_into(model: nn.Module, tensors: dict[str, torch.Tensor], normalize_key, may_be_missing=(),
              rows: dict[str, int] | None = None) -> None:
    """Copies checkpoint `tensors` into `model`, or raises PretrainedCheckpointError naming every mismatch.

    Keys that ``normalize_key`` maps to None are ignored. A tied weight needs to
    be present under only one of its names. Parameters whose names start with one
    of `may_be_missing` (a fresh task head) keep their initial values if absent.
    `rows` names tensors whose checkpoint holds only their first rows (a padded
    vocabulary's real ones); the rows after them are set to zero.
    """
    rows = rows or {}
    expected = {name: tensor[:rows[name]] if name in rows else tensor for name, tensor in model.state_dict().items()}
    provided = {}
    for key, tensor in tensors.items():
        name = normalize_key(key)
        if name is not None:
            provided[name] = tensor
    # Names that alias another parameter (tied weights) are satisfied by any one of them.
    by_storage: dict[int, list[str]] = {}
    for name, tensor in expected.items():
        by_storage.setdefault(tensor.data_ptr(), []).append(name)
    missing = [
        names[0] if len(names) == 1 else " or ".join(names)
        for names in by_storage.values()
        if not any(name in provided or name.startswith(tuple(may_be_missing)) for name in names)
    ]
    unexpected = sorted(set(provided) - set(expected))
    mis_shaped = [
        f"{name}: checkpoint {tuple(provided[name].shape)}, model {tuple(expected[name].shape)}"
        for name in provided
        if name in expected and provided[name].shape != expected[name].shape
    ]
    problems = []
    if missing:
        problems.append("missing: " + ", ".join(sorted(missing)))
    if unexpected:
        problems.append("unexpected: " + ", ".join(unexpected))
    if mis_shaped:
        problems.append("mis-shaped: " + "; ".join(mis_shaped))
    if problems:
        raise PretrainedCheckpointError(f"checkpoint does not fit {type(model).__name__}: " + " | ".join(problems))
    with torch.no_grad():
        for name, tensor in provided.items():
            expected[name].copy_(tensor)
        state = model.state_dict()
        for name, kept in rows.items():
            state[name][kept:].zero_()


def save(model: nn.Module, directory: str | Path, config: dict, rows: dict[str, int] | None = None) -> Path:
    """Writes ``model.safetensors`` (each tied weight once; of a tensor named in `rows`, its first rows only)
    and an HF-style ``config.json``."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state, seen = {}, set()
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() in seen:  # safetensors stores no aliases; loading re-ties
            continue
        seen.add(tensor.data_ptr())
        state[name] = tensor[:(rows or {}).get(name)].detach().contiguous().cpu()
    save_file(state, str(directory / WEIGHT_FILES[0]), metadata={"format": "pt"})
    (directory / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    return directory

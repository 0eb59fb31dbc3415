"""A ``--save-dir`` directory: the trained weights in Hugging Face's layout, and ``run.json`` beside them.

The weights (``model.safetensors``, ``config.json``) say what the model is; ``run.json``
says how it was trained: the experiment, its options (model, sequence length,
tokenizer, seed) and where it ran. ``eval.py`` rebuilds the run's validation data
from it, so a user names only the directory.
"""

import json
from pathlib import Path

from training.options import RunConfig

RUN_FILE = "run.json"
# Where things were on the machine that trained: meaningless elsewhere, so not kept.
MACHINE_PATHS = ("data_dir", "out_dir", "save_dir", "checkpoint_dir")


class SavedRunError(Exception):
    """A directory that is not a complete ``--save-dir`` of run_gpt2.py or run_bert.py."""


def save_trained(task, state: dict | None, config: RunConfig, trained: dict) -> None:
    """Rank 0 writes the trained weights in Hugging Face's layout to --save-dir, the task's extras and run.json.

    `trained`: the run's fixed CSV columns (``RunRecorder.fixed``).
    """
    if state is None:
        return
    directory = Path(config.save_dir)
    model = task.build_model()
    model.load_state_dict(state)
    model.save_pretrained(directory)
    if hasattr(task, "save_extras"):
        task.save_extras(directory)
    write_run_file(directory, trained["experiment"], config.as_dict(), trained)


def write_run_file(directory: Path, experiment: str, options: dict, trained: dict) -> None:
    """`options`: the command line's values; `trained`: the run's fixed CSV columns (id, strategy, ranks, commit)."""
    kept = {name: value for name, value in options.items() if name not in MACHINE_PATHS}
    (directory / RUN_FILE).write_text(json.dumps({"experiment": experiment, "trained": trained, "options": kept},
                                                 indent=2) + "\n")


def read_run_file(directory: str | Path, experiments) -> dict:
    """The run description in `directory`, checked to name one of `experiments` and to have its weights beside it."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SavedRunError(f"{directory}: no such directory (give a run_gpt2.py or run_bert.py --save-dir)")
    path = directory / RUN_FILE
    if not path.is_file():
        raise SavedRunError(f"{path} is missing: {directory} is not a run_gpt2.py or run_bert.py --save-dir "
                            "directory, or it was saved before run.json existed (train it again with --save-dir)")
    try:
        description = json.loads(path.read_text())
        experiment, options = description["experiment"], description["options"]
    except (ValueError, KeyError, TypeError) as error:
        raise SavedRunError(f"{path}: not a run description ({error!r})") from error
    if experiment not in experiments:
        raise SavedRunError(f"{path}: unknown experiment {experiment!r} (expected one of {', '.join(experiments)})")
    if not isinstance(options, dict):
        raise SavedRunError(f"{path}: 'options' must be a mapping")
    for needed in ("config.json", "model.safetensors"):
        if not (directory / needed).is_file():
            raise SavedRunError(f"{directory / needed} is missing: the save was interrupted or files were removed "
                                "(train again with --save-dir)")
    return description

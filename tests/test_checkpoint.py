"""Sharded checkpoints (resume, reshard, crashes, damage), deferred initialisation and the Hugging Face export.

The files are checked here, in the pytest process, with ``consolidate_checkpoint``
(which needs no MPI); training and loading run in workers/checkpoint.py under mpiexec.
"""

import json
import math
import shutil

import pytest
import torch
from mpi_launch import check_ok, run_mpi

from fsdp_mpi import CheckpointError, consolidate_checkpoint

# torch's serialisation, meta tensors and storages under every checkpoint: CI runs the file on the newest torch too.
pytestmark = pytest.mark.torch_range

U = torch.finfo(torch.float32).eps / 2


def train(tmp_path, name: str, nprocs: int, *args) -> dict:
    out, directory = tmp_path / f"{name}.json", tmp_path / name
    directory.mkdir()
    check_ok(run_mpi("checkpoint.py", nprocs, out, "train", directory, *map(str, args)))
    return {int(step): loss for step, loss in json.loads(out.read_text())["losses"].items()}


def assert_same_parameters_and_optimizer_state(a: dict, b: dict) -> None:
    """Parameters, buffers and per-parameter optimizer state of two consolidated checkpoints are bitwise equal."""
    assert a["model"].keys() == b["model"].keys()
    for name in a["model"]:
        assert torch.equal(a["model"][name], b["model"][name]), name
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for name, state in a["optimizer"]["state"].items():
        for key, value in state.items():
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(b["optimizer"]["state"][name][key])), (name, key)


def assert_same_state(a: dict, b: dict) -> None:
    """As above, and the same optimizer parameter groups (learning rates, decay)."""
    assert_same_parameters_and_optimizer_state(a, b)
    assert a["optimizer"]["param_groups"] == b["optimizer"]["param_groups"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """2 ranks, 6 steps with dropout, a checkpoint after step 3."""
    tmp_path = tmp_path_factory.mktemp("uninterrupted")
    return tmp_path, train(tmp_path, "run", 2, 6, "--save-at", 3)


def test_resume_on_the_same_ranks_continues_bit_for_bit(uninterrupted, tmp_path):
    run_dir, losses = uninterrupted
    resumed = train(tmp_path, "resumed", 2, 6, "--resume", run_dir / "run" / "ckpt")
    assert list(resumed) == [3, 4, 5]
    assert all(resumed[step] == losses[step] for step in resumed)  # dropout too: each rank's generator is restored
    assert_same_state(consolidate_checkpoint(run_dir / "run" / "final"),
                      consolidate_checkpoint(tmp_path / "resumed" / "final"))


@pytest.mark.one_mpi  # the checkpoint files' logic, whatever MPI moves the bytes
def test_reshard_2_to_3_to_1_keeps_every_bit_and_continues_the_run(tmp_path):
    """Without dropout, a resharded run differs from the uninterrupted one only by the order of sums. The 3-rank
    run is offloaded (CPUOffload): its files are the same as any, loaded from and loaded by runs that are not."""
    losses = train(tmp_path, "two", 2, 6, "--save-at", 3, "--dropout", 0)
    three = train(tmp_path, "three", 3, 6, "--resume", tmp_path / "two" / "ckpt", "--save-after-load",
                  tmp_path / "three" / "loaded", "--save-at", 4, "--dropout", 0, "--offload")
    one = train(tmp_path, "one", 1, 6, "--resume", tmp_path / "three" / "ckpt", "--save-after-load",
                tmp_path / "one" / "loaded", "--dropout", 0)
    # Loading on another world size changes nothing: saved again at once, the state is the same bits.
    assert_same_state(consolidate_checkpoint(tmp_path / "two" / "ckpt"),
                      consolidate_checkpoint(tmp_path / "three" / "loaded"))
    assert_same_state(consolidate_checkpoint(tmp_path / "three" / "ckpt"),
                      consolidate_checkpoint(tmp_path / "one" / "loaded"))
    # The first loss after each load is computed from the same parameters on another split of the same
    # batch: float32 sums over the 12 x 16 tokens may round differently, at most 192 u relative.
    assert three[3] == pytest.approx(losses[3], rel=192 * U, abs=0)
    assert one[4] == pytest.approx(three[4], rel=192 * U, abs=0)
    # Later steps follow the same trajectory: rounding that AdamW amplifies stays far below what one
    # step changes, so a run that restarted, skipped or repeated a step could not pass.
    for step in (4, 5):
        one_step = abs(losses[step] - losses[step - 1])
        assert abs(three[step] - losses[step]) < one_step / 10
        assert abs(one.get(step, three[step]) - losses[step]) < one_step / 10


@pytest.mark.one_mpi  # the checkpoint files' logic, whatever MPI moves the bytes
def test_reshard_3_to_2_with_dropout_loads_every_bit_and_trains_on(tmp_path):
    """Fewer ranks than saved, and not a divisor of them, with dropout on: the parameters and the optimizer
    state load bit for bit (saved again at once), and the run goes on from the saved step.

    The same state whole (``full_state_dict``, ``full_optimizer_state_dict``: a one-file checkpoint's, as
    Lightning's) is the consolidated checkpoint, bit for bit, AdamW's two parameter groups included; loaded on
    the 2 ranks (``load_full_optimizer_state_dict``), it gives them the same shards as the sharded load."""
    train(tmp_path, "three", 3, 6, "--save-at", 3, "--full-at-save")
    two = train(tmp_path, "two", 2, 6, "--resume", tmp_path / "three" / "ckpt", "--save-after-load",
                tmp_path / "two" / "loaded", "--reload-full", tmp_path / "three" / "ckpt-full.pt")
    saved = consolidate_checkpoint(tmp_path / "three" / "ckpt")
    assert_same_state(saved, consolidate_checkpoint(tmp_path / "two" / "loaded"))
    full = torch.load(tmp_path / "three" / "ckpt-full.pt", weights_only=True)
    assert_same_state(saved, full)
    assert all(state.keys() == {"step", "exp_avg", "exp_avg_sq"} for state in full["optimizer"]["state"].values())
    assert_same_state(saved, consolidate_checkpoint(tmp_path / "two" / "loaded-full"))
    assert list(two) == [3, 4, 5] and all(math.isfinite(loss) for loss in two.values())  # on from the saved step


def test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_whole(tmp_path):
    result = run_mpi("checkpoint.py", 2, tmp_path / "out.json", "crash", tmp_path)
    assert result.returncode != 0
    assert json.loads((tmp_path / "out.json").read_text()) == {"saved": True}  # the first save completed
    assert (tmp_path / "ckpt.tmp").exists()  # the second never reached the rename
    assert (tmp_path / "ckpt" / "index.json").exists(), "the previous checkpoint is gone"
    assert consolidate_checkpoint(tmp_path / "ckpt")["extra"]["step"] == 1  # every checksum still matches
    # The next save replaces the leftovers: resuming from it works and saves again.
    train(tmp_path, "after", 2, 2, "--resume", tmp_path / "ckpt", "--save-after-load", tmp_path / "ckpt")
    assert not (tmp_path / "ckpt.tmp").exists() and not (tmp_path / "ckpt.old").exists()


@pytest.mark.parametrize("damage", ["corrupt", "truncate", "delete"])
def test_a_damaged_file_is_named(uninterrupted, tmp_path, damage):
    directory = tmp_path / "ckpt"
    shutil.copytree(uninterrupted[0] / "run" / "ckpt", directory)
    victim = directory / "rank-00001.safetensors"
    data = bytearray(victim.read_bytes())
    if damage == "corrupt":
        data[len(data) // 2] ^= 0xFF
        victim.write_bytes(bytes(data))
    elif damage == "truncate":
        victim.write_bytes(bytes(data[:-100]))
    else:
        victim.unlink()
    expected = {"corrupt": "corrupted", "truncate": "truncated", "delete": "missing"}[damage]
    with pytest.raises(CheckpointError, match=rf"rank-00001\.safetensors.*{expected}"):
        consolidate_checkpoint(directory)
    if damage == "corrupt":  # under MPI: every rank stops with the same message instead of waiting
        result = run_mpi("checkpoint.py", 2, tmp_path / "out.json", "train", tmp_path, "4", "--resume", directory)
        assert result.returncode != 0
        assert "rank-00001.safetensors: contents differ from the index's sha256" in result.stderr


@pytest.mark.one_mpi  # the checkpoint files' logic, whatever MPI moves the bytes
def test_a_checkpoint_of_another_model_names_the_keys_and_changes_nothing(uninterrupted, tmp_path):
    out = tmp_path / "out.json"
    check_ok(run_mpi("checkpoint.py", 2, out, "mismatch", uninterrupted[0] / "run" / "ckpt"))
    result = json.loads(out.read_text())
    assert result["unchanged"]
    assert "does not fit this model" in result["error"]
    assert "missing from the checkpoint: bert.embeddings.LayerNorm.bias" in result["error"]
    assert "not in the model: lm_head.weight" in result["error"] or "not in the model: transformer." in result["error"]


def test_an_incomplete_directory_is_not_taken_for_a_checkpoint(tmp_path):
    (tmp_path / "ckpt.tmp").mkdir()
    with pytest.raises(CheckpointError, match=r"index\.json: no such file.*a save into it was interrupted"):
        consolidate_checkpoint(tmp_path / "ckpt")


@pytest.mark.one_mpi  # the checkpoint files' logic, whatever MPI moves the bytes
@pytest.mark.parametrize("nprocs", [2, 3])
def test_deferred_initialisation_equals_eager_construction_bit_for_bit(tmp_path, nprocs):
    out = tmp_path / "out.json"
    check_ok(run_mpi("checkpoint.py", nprocs, out, "deferred"))
    result = json.loads(out.read_text())
    for model in ("gpt2", "bert"):  # each rank seeded differently: rank 0's generator state is used
        assert result[model]["keys"] and result[model]["differing"] == [], model
    assert math.isfinite(result["gpt2"]["loss"])
    errors = result["errors"]
    assert errors["no_reset"].startswith("TypeError: NoReset has parameters but no reset_parameters()")
    assert "changed parameters it does not own directly" in errors["touches_children"]
    assert "(cpu, meta)" in errors["mixed"]


@pytest.mark.one_mpi  # the checkpoint files' logic, whatever MPI moves the bytes
def test_export_streams_hugging_face_files_that_load_anywhere(tmp_path, monkeypatch):
    out = tmp_path / "out.json"
    check_ok(run_mpi("checkpoint.py", 2, out, "export", tmp_path))
    result = json.loads(out.read_text())
    # Loaded back into shards of a meta-built model: the same weights, the same logits.
    assert result["differing"] == [] and result["logit_difference"] == 0.0
    assert "expected a .safetensors file" in result["bad_path"]
    hf_dir = tmp_path / "hf"
    index = json.loads((hf_dir / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1
    for name in files:  # tensor bytes up to the limit, or one tensor larger than it alone
        sizes = _tensor_bytes(hf_dir / name)
        assert sum(sizes) <= 100_000 or len(sizes) == 1, (name, sizes)
    # transformers loads every tensor bit for bit (the tied head from the embedding), the vocabulary's 100 words
    # without the 28 rows that pad it in memory (zero there, and zero again when loaded: "differing" is empty).
    import tqdm
    import transformers

    # Its loading bar would leave tqdm's monitor thread in this process, and a later test's fork would copy it.
    monkeypatch.setattr(tqdm.tqdm, "monitor_interval", 0)
    hf = transformers.GPT2LMHeadModel.from_pretrained(hf_dir)
    expected = torch.load(tmp_path / "expected.pt", weights_only=True)
    hf_state = hf.state_dict()
    assert expected["transformer.wte.weight"].shape == (128, 64)
    assert hf_state["transformer.wte.weight"].shape == (100, 64)
    assert not expected["transformer.wte.weight"][100:].any()
    for name, tensor in expected.items():
        assert torch.equal(hf_state[name], tensor[:len(hf_state[name])] if tensor.dim() else tensor), name


def _tensor_bytes(path) -> list[int]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as file:
        return [file.get_tensor(key).numel() * file.get_tensor(key).element_size() for key in file.keys()]

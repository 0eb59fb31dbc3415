"""fsdp_mpi.lightning.FSDPMPIStrategy: a Lightning Trainer on 2 ranks matches plain torch in one process,
and its checkpoint's Lightning state loads so that it cannot run code unless the user says weights_only=False."""

import json
import os
import re

import pytest
import torch

from mpi_launch import check_ok, run_mpi

pytest.importorskip("lightning")

from fsdp_mpi import CheckpointError  # noqa: E402 (after the skip: fsdp_mpi.lightning imports Lightning)
from fsdp_mpi.lightning import load_lightning_state  # noqa: E402

# the strategy fills Lightning's and torch's hooks: CI runs the file on the newest torch too.
pytestmark = pytest.mark.torch_range

FP32_EPS = torch.finfo(torch.float32).eps


def test_lightning_trainer_with_fsdp_mpi_matches_one_process_resumes_and_mixes_precision(tmp_path):
    out = tmp_path / "report.json"
    check_ok(run_mpi("lightning_strategy.py", 2, out, tmp_path, timeout=300))
    report = json.loads(out.read_text())
    # 4 SGD steps (lr 0.1, momentum 0.9) on the same global batch. Each gradient is a sum over at most 16
    # samples of products over 8 inputs, so the 2 ranks' mean and one process's differ by at most 16 float32
    # roundings of the gradient norm; the momentum carries a step's gradient into later updates with total
    # weight below 1 + 1.9 + 2.71 + 3.44 < 10, and each of the 4 updates rounds the weight once.
    lr, eps = 0.1, FP32_EPS
    for run in ("unclipped", "clipped"):
        largest_gradient = max(report[f"{run}_gradient_norms"])
        bound = lr * 10 * 16 * eps * largest_gradient + 4 * eps * report[f"{run}_scale"]
        assert report[f"{run}_max_difference"] <= bound
    # Clipping at 0.05 acted on every step (the reference's norms before clipping are above it), and changed
    # the training: the unclipped reference's norms shrink as it fits, the clipped one's stay near the first.
    assert min(report["clipped_gradient_norms"]) > 0.05
    assert report["unclipped_gradient_norms"] != report["clipped_gradient_norms"]
    # Lightning's teardown after fit leaves the sharded module where it is (it would move it to the CPU).
    assert report["moves_to_cpu"] == 0
    # Lightning's own collectives go through MPI: ranks hold 1.0 and 2.0.
    assert (report["reduce_sum"], report["reduce_mean"], report["all_gather"]) == (3.0, 1.5, [1.0, 2.0])
    assert report["broadcast"] == "from 1"
    # Resumed from the checkpoint after step 2 (shards, momentum, loops), offloaded: bit for bit the run that went on.
    assert report["resumed_global_step"] == 4 and report["resumed_difference"] == 0.0
    # Lightning's weights_only reaches the state file: by default a state holding more than tensors and plain
    # values (here a path object) is refused on every rank, naming the file; weights_only=False loads it, and
    # rank 0 alone warns.
    for refusal in report["default_refusals"]:
        assert refusal and re.match(r".*with-a-path\.ckpt/lightning_state\.pt: refused: .*PurePosixPath.*"
                                    r"weights_only=False", refusal), refusal
    assert report["unsafe_notes"] == ["trusted", "trusted"]
    assert report["unsafe_warnings"] == [1, 0]
    # precision="bf16-mixed" becomes fsdp_mpi's MixedPrecision: blocks compute in bf16 over fp32 masters.
    assert report["precision_plugin"] == report["bf16_plugin"] == "FSDPMPIPrecision"
    assert report["bf16_compute_dtypes"] == ["torch.bfloat16"]
    assert report["bf16_master_dtypes"] == ["torch.float32"]
    # FSDPMPIStrategy(compression=...) reaches the wrapper: int8 gathers and an all-to-all of the gradients.
    assert {"all_gather", "all_to_all"} <= set(report["compressed_operations"])
    assert "reduce_scatter" not in report["compressed_operations"]
    # One SGD step from the same start: int8 weights (each within 1/254 of its block's absmax) and int8
    # gradients change the update by a few hundredths of lr x gradient; not at all would mean no compression,
    # and a broken codec (a scale ignored) moves the weights by their own size.
    assert 0 < report["compressed_difference"] < 0.05 * report["compressed_scale"]


class RunsCodeWhenUnpickled:
    """Unpickling this calls os.mkdir(marker): a stand-in for a state file crafted to run code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (str(self.marker),)


def test_a_state_file_that_would_run_code_is_refused_unless_weights_only_false_is_passed(tmp_path):
    marker, path = tmp_path / "code-ran", tmp_path / "lightning_state.pt"
    torch.save({"epoch": 0, "payload": RunsCodeWhenUnpickled(marker)}, path)
    for weights_only in (None, True):  # None: what Lightning passes unless told otherwise
        with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: refused: .*would call or build "
                                                  r"\w+\.mkdir\. If you trust the file, pass weights_only=False"):
            load_lightning_state(path, weights_only)
        assert not marker.exists()
    # Passed explicitly, weights_only=False is obeyed, with a warning: the payload runs (so what was refused
    # above was live code).
    with pytest.warns(UserWarning, match=rf"^{re.escape(str(path))}: loading with weights_only=False.*trust"):
        state = load_lightning_state(path, weights_only=False)
    assert marker.is_dir() and state["epoch"] == 0


def test_a_missing_damaged_or_foreign_state_file_gets_an_error_naming_it(tmp_path):
    path = tmp_path / "lightning_state.pt"
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: missing"):
        load_lightning_state(path)
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: refused: .*damaged"):
        load_lightning_state(path)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: unreadable"), pytest.warns(UserWarning):
        load_lightning_state(path, weights_only=False)
    torch.save([1, 2], path)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: holds a list, not Lightning's state"):
        load_lightning_state(path)


@pytest.mark.one_rank
def test_the_strategy_takes_lightning_fsdp_options_and_refuses_bad_ones_when_made():
    """As Lightning's FSDPStrategy: a strategy's name in any case, a set of classes or a policy in torch's form;
    a bad one fails when the strategy is made, not when the Trainer sets the model up."""
    import functools

    from torch import nn
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    from fsdp_mpi import ShardingStrategy
    from fsdp_mpi.lightning import FSDPMPIStrategy

    strategy = FSDPMPIStrategy(auto_wrap_policy=functools.partial(transformer_auto_wrap_policy,
                                                                  transformer_layer_cls={nn.Linear}),
                               sharding_strategy="shard_grad_op")
    assert strategy.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert strategy.auto_wrap_policy.should_wrap(nn.Linear(1, 1), 2)
    assert not strategy.auto_wrap_policy.should_wrap(nn.ReLU(), 0)
    with pytest.raises(TypeError, match=r"sharding_strategy must be .* or the name, got 'ZERO3'"):
        FSDPMPIStrategy(sharding_strategy="ZERO3")
    with pytest.raises(TypeError, match="auto_wrap_policy must be"):
        FSDPMPIStrategy(auto_wrap_policy="Linear")


@pytest.mark.one_rank
def test_a_lost_rank_is_said_plainly_to_end_a_trainer(capfd, monkeypatch):
    """Lightning's Trainer cannot be rebuilt on the survivors in the middle of fit(): the strategy says so when it
    meets a lost rank, and as it starts a job launched to go on without one."""
    from fsdp_mpi import RankLostError
    from fsdp_mpi.lightning import FSDPMPIStrategy

    strategy = FSDPMPIStrategy()
    strategy.on_exception(ValueError("not a lost rank"))
    assert capfd.readouterr().err == ""
    strategy.on_exception(RankLostError("rank 0 of 2 in #7 all_gather", 0.04))
    said = capfd.readouterr().err
    assert said.startswith("fsdp_mpi.lightning: rank 0: rank 0 of 2 in #7 all_gather. Lightning's Trainer cannot "
                           "go on without a lost rank")
    assert "fit(ckpt_path=...)" in said and "fsdp_mpi.run_elastic" in said
    monkeypatch.setattr("fsdp_mpi.lightning.can_go_on", lambda: True)
    monkeypatch.setattr("lightning.pytorch.strategies.ParallelStrategy.setup_environment", lambda self: None)
    strategy.setup_environment()  # the part before Lightning's own (which needs a Trainer's accelerator)
    assert "Lightning's Trainer cannot go on without a lost rank" in capfd.readouterr().err

"""fsdp_mpi.lightning.FSDPMPIStrategy: a Lightning Trainer on 2 ranks matches plain torch in one process,
and its checkpoint's Lightning state loads so that it cannot run code unless the user says weights_only=False."""

import json
import os
import re
import subprocess
import sys

import pytest
import torch

from mpi_launch import WORKERS, check_ok, child_env, mpiexec, only_these_slots, python_command, run_mpi

pytest.importorskip("lightning")

from fsdp_mpi import CheckpointError  # noqa: E402 (after the skip: fsdp_mpi.lightning imports Lightning)
from fsdp_mpi.communication.failures.lost_ranks import ULFM_LAUNCH  # noqa: E402
from fsdp_mpi.lightning import load_lightning_state  # noqa: E402

# the strategy fills Lightning's and torch's hooks: CI runs the file on the newest torch too.
pytestmark = pytest.mark.torch_range

FP32_EPS = torch.finfo(torch.float32).eps
HOST_SUITE = os.path.join(os.path.dirname(__file__), "host_suites", "lightning")  # Lightning's own tests, by hand


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
    assert report["reduce_max_min"] == [2.0, 1.0]  # sync_dist=True with reduce_fx="max" or "min"
    # An optimizer built before the model was sharded would step tensors that no longer train: refused by name.
    assert report["early_optimizer"] and re.match(r"SGD holds 6 parameters that are not the sharded model's: build "
                                                  r"the optimizer inside configure_optimizers", report["early_optimizer"])
    assert report["broadcast"] == "from 1"
    # Resumed from each run's checkpoint after its first epoch (weights, momentum, loops), from Lightning's one
    # file offloaded and from shards: bit for bit the run that went on.
    for kind in ("full", "sharded"):
        assert report[f"{kind}_resumed_global_step"] == 4 and report[f"{kind}_resumed_difference"] == 0.0
    # The one file (state_dict_type "full", the default) is Lightning's own: LightningModule.load_from_checkpoint
    # in one process, without fsdp_mpi, gives the trained weights, and the momentum in it, cut where each rank's
    # shards are, is theirs: bit for bit (gathering moves bits, it computes nothing).
    assert report["full_checkpoint_is_a_file"] and report["full_loaded_difference"] == 0.0
    assert report["full_optimizer_is_the_shards"] == [True, True]
    # Lightning's weights_only reaches the state's loading, from a file or a directory: by default a state
    # holding more than tensors and plain values (here a path object) is refused on every rank, naming the
    # file; weights_only=False loads it, and rank 0 alone warns.
    for kind, state_file in (("full", r"with-a-path-full\.ckpt"),
                             ("sharded", r"with-a-path-sharded\.ckpt/lightning_state\.pt")):
        for refusal in report[f"{kind}_refusals"]:
            assert refusal and re.match(rf".*{state_file}: refused: .*PurePosixPath.*weights_only=False",
                                        refusal), refusal
        assert report[f"{kind}_unsafe_notes"] == ["trusted", "trusted"]
        assert report[f"{kind}_unsafe_warnings"] == [1, 0]
        # fit(ckpt_path=..., weights_only=False) reaches it too (Lightning drops it for a strategy that restores
        # after setup, so this one restores before).
        assert report[f"{kind}_trusted_resume"] == 4
    # validate() after fit() on the same module wraps its shards again: it logs the loss that the trained
    # shards give outside Lightning (the same forward on the same samples; Lightning's sums and the reduction's
    # cast to float32 round it at most a few times) and leaves the weights; a Trainer asking for other
    # settings is refused, naming them.
    assert abs(report["validated_loss"] - report["outside_lightning_loss"]) <= 4 * eps * report["validated_loss"]
    assert report["validated_weights_kept"]
    assert report["settings_refusal"] and re.match(r"Regression was sharded with other settings \(mixed_precision: "
                                                   r".*bfloat16", report["settings_refusal"]), report["settings_refusal"]
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
    # SLURM's auto-requeue, as Lightning's SLURMEnvironment asks for it in a batch job: the signal reached rank 1
    # alone, before step 2's first micro-batch of two. Both ranks stopped after that step, not inside it (their
    # agreement, at the step's end), saved Lightning's hpc_ckpt_1,
    # rank 0 alone asked scontrol to requeue the job, and fit ended with STOPPED_WITH_CHECKPOINT on both, the signal
    # handled again as before. The requeued job's Trainer, given no checkpoint, resumed from the file by itself
    # and ended bit for bit as the run never stopped.
    assert report["requeue_exit_codes"] == [report["stopped_with_checkpoint"]] * 2 == [3, 3]
    assert report["requeue_stopped_after"] == [2, 2]
    assert report["requeue_files"] == ["hpc_ckpt_1.ckpt"] and report["requeue_calls"] == ["requeue 4242"]
    assert report["requeue_handler_restored"] == [True, True]
    assert report["requeue_resumed_global_step"] == 4 and report["requeue_resumed_difference"] == 0.0
    # The same under fit_elastic: the requeue's checkpoint is fit_elastic's own, at the step of the stop (its
    # periodic saves come every 3 steps), so the requeued job's fit_elastic loses no step, and ends bit for bit.
    assert report["elastic_requeue_exit_codes"] == [3, 3] and report["elastic_requeue_latest"] == "step-00000002"
    assert report["elastic_requeue_calls"] == ["requeue 4242"] * 2
    assert report["elastic_requeue_resumed_global_step"] == 4 and report["elastic_requeue_resumed_difference"] == 0.0


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
    with pytest.raises(ValueError, match="state_dict_type must be 'full' or 'sharded', not 'SHARDED_STATE_DICT'"):
        FSDPMPIStrategy(state_dict_type="SHARDED_STATE_DICT")


@pytest.mark.one_rank
def test_the_plugin_for_lightnings_own_tests_puts_the_strategy_where_lightning_would_choose_one_device():
    """tests/host_suites/lightning: with the plugin configured, a Trainer left to choose on one CPU gets
    FSDPMPIStrategy; one that names its strategy keeps it."""
    import lightning as L
    from lightning.pytorch.strategies import DDPStrategy

    from fsdp_mpi.lightning import FSDPMPIStrategy
    sys.path.insert(0, str(HOST_SUITE))
    import fsdp_mpi_in_place_of_auto

    fsdp_mpi_in_place_of_auto.pytest_configure(None)
    assert isinstance(L.Trainer(accelerator="cpu", devices=1, logger=False).strategy, FSDPMPIStrategy)
    assert isinstance(L.Trainer(accelerator="cpu", devices=1, strategy=DDPStrategy(), logger=False).strategy,
                      DDPStrategy)


def test_every_lightning_test_listed_as_failing_by_design_has_its_reason_once():
    """by_design.txt, which run_lightning_tests.py holds each failure of Lightning's tests against: every entry
    is a test of Lightning's with a reason (its own or the next one's), and no entry is there twice."""
    sys.path.insert(0, str(HOST_SUITE))
    import run_lightning_tests

    entries = [line.partition("  # ")[0].strip() for line in run_lightning_tests.BY_DESIGN.read_text().splitlines()
               if line.strip() and not line.startswith("#")]
    reasons = run_lightning_tests.by_design()
    assert len(entries) > 50 and sorted(entries) == sorted(reasons), set(entries) ^ set(reasons)
    assert all(re.fullmatch(r"tests_pytorch(\.\w+)+::\w+(\[.*\])?", entry) for entry in entries), entries
    assert all(reasons.values())


@pytest.mark.one_rank
def test_a_lost_rank_is_said_plainly_to_end_a_trainer_unless_fit_elastic_drives_it(capfd, monkeypatch, tmp_path):
    """A Trainer cannot be rebuilt on the survivors in the middle of fit(): the strategy says so, and how to go on
    (fit_elastic), when it meets a lost rank, and as it starts a job launched to go on without one; under
    fit_elastic it says neither. fit_elastic refuses what it cannot drive before anything starts."""
    from fsdp_mpi import Communicator, RankLostError
    from fsdp_mpi.lightning import FSDPMPIStrategy
    from fsdp_mpi.lightning_elastic import fit_elastic

    strategy = FSDPMPIStrategy()
    strategy.on_exception(ValueError("not a lost rank"))
    assert capfd.readouterr().err == ""
    strategy.on_exception(RankLostError("rank 0 of 2 in #7 all_gather", 0.04))
    said = capfd.readouterr().err
    assert said.startswith("fsdp_mpi.lightning: rank 0: rank 0 of 2 in #7 all_gather. a Trainer cannot go on "
                           "without a lost rank")
    assert "fit(ckpt_path=...)" in said and "fsdp_mpi.lightning_elastic.fit_elastic" in said
    monkeypatch.setattr("fsdp_mpi.lightning.can_go_on", lambda: True)
    monkeypatch.setattr("lightning.pytorch.strategies.ParallelStrategy.setup_environment", lambda self: None)
    strategy.setup_environment()  # the part before Lightning's own (which needs a Trainer's accelerator)
    assert "a Trainer cannot go on without a lost rank" in capfd.readouterr().err
    strategy.keeps_going = True  # as fit_elastic makes it
    strategy.setup_environment()
    strategy.on_exception(RankLostError("rank 0 of 2 in #7 all_gather", 0.04))
    assert capfd.readouterr().err == ""

    import lightning as L

    comm = Communicator()
    trainer = lambda strategy: L.Trainer(strategy=strategy, accelerator="cpu", devices=1, logger=False)  # noqa: E731
    refusals = [
        (dict(build=lambda on: (trainer(FSDPMPIStrategy(comm=on)), L.LightningModule()), checkpoint_every=0),
         ValueError, "checkpoint_every must be at least 1"),
        (dict(build=lambda on: None, checkpoint_every=1, hosts_file=tmp_path / "hosts"), ValueError,
         "hosts_file .* needs grow_back=True"),
        (dict(build=lambda on: L.LightningModule(), checkpoint_every=1), TypeError,
         r"build\(comm\) must return \(trainer, module\) or \(trainer, module, datamodule\)"),
        (dict(build=lambda on: (trainer(FSDPMPIStrategy()), L.LightningModule()), checkpoint_every=1), TypeError,
         r"must train with FSDPMPIStrategy\(comm=comm, ...\) on the communicator it is given"),
        (dict(build=lambda on: (trainer("ddp"), L.LightningModule()), checkpoint_every=1), TypeError,
         r"FSDPMPIStrategy\(comm=comm, ...\) .*\(its strategy: DDPStrategy\)"),
    ]
    for arguments, error, message in refusals:
        with pytest.raises(error, match=message):
            fit_elastic(checkpoint_dir=tmp_path / "checkpoints", comm=comm, **arguments)
    assert not (tmp_path / "checkpoints").exists()  # nothing was started


@pytest.mark.open_mpi
@pytest.mark.parametrize("strategy, shard_groups", [("FULL_SHARD", [4, 4, 2, 2, 4, 4]),
                                                    ("HYBRID_SHARD", [2] * 6)],  # a group per node
                         ids=["FULL_SHARD", "HYBRID_SHARD"])
def test_fit_elastic_goes_on_shrunk_after_a_lost_node_and_grows_back_into_an_added_host(strategy, shard_groups,
                                                                                       tmp_path):
    """FULL_SHARD, or HYBRID_SHARD (a shard group per node, the nodes replicas of each other), on 2 emulated nodes
    of 2 ranks, no slot to spare, a checkpoint every 2 steps: node 1's ranks die as step 3 starts; the 2
    survivors build the Trainer again and resume the step-2 checkpoint (fit_elastic resumes from checkpoints
    only, HYBRID_SHARD's whole replica too); once a host is added to the hosts file (after step 4) the run grows
    back to 4 ranks at the next step's agreement, resuming the step-4 checkpoint. Every step's loss, and the
    final weights, are plain torch's in one process."""
    run, result = fit_elastic_run(tmp_path, strategy, "localhost:6")
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    assert [line.split(". Noticed")[0].split(", in ")[0] for line in result["recoveries"]] == [
        "lost rank(s) 2, 3 of the job (4 training before); 2 rank(s) go on from the latest checkpoint at optimizer "
        "step 2",
        "hosts were added: grown back from 2 to 4 rank(s), newcomers in rank(s) 2, 3, going on from the latest "
        "checkpoint at optimizer step 4"]
    assert result["ranks"] == [4, 4, 2, 2, 4, 4]  # each step's, as last taken
    assert result["shard_groups"] == shard_groups
    assert_trains_as_one_process(result)


@pytest.mark.open_mpi
def test_fit_elastic_goes_on_after_a_loss_while_it_rebuilds_and_after_a_growth_that_cannot_start(tmp_path):
    """HYBRID_SHARD (a shard group per node, the nodes replicas of each other) on 2 emulated nodes of 2 ranks:
    node 1's ranks die as step 3 starts, and rank 1 as the survivors build their Trainer again, so the recovery
    starts again, on rank 0 alone, from the step-2 checkpoint. After step 4 the hosts file names this host with
    no more slots than the job took (its 4, the dead ones' included): Open MPI refuses to start the newcomers of
    the free slots (MPI_ERR_UNKNOWN), the Trainer the growth interrupted is built again from the step-4
    checkpoint and finishes on rank 0 alone (the same Trainer fitted again would find its module wrapped
    already). `mpirun` then exits with 213, as after any refused spawn (docs/failures.md)."""
    run, result = fit_elastic_run(tmp_path, "HYBRID_SHARD", "localhost:4", "1")
    said = run.stdout + run.stderr
    assert run.returncode == 213, said[-4000:]
    assert "no newcomer can start in the place of rank(s) 1, 2, 3 (MPI_ERR_UNKNOWN" in said
    assert [line.split(". Noticed")[0] for line in result["recoveries"]] == [
        "lost rank(s) 1, 2, 3 of the job (4 training before); 1 rank(s) go on from the latest checkpoint at optimizer "
        "step 2",
        "hosts were added, but no newcomer could start: 1 rank(s) go on as they were, from the latest checkpoint at "
        "optimizer step 4"]
    assert result["ranks"] == [4, 4, 1, 1, 1, 1]
    assert result["shard_groups"] == [2, 2, 1, 1, 1, 1]  # each node's ranks, then rank 0's own
    assert_trains_as_one_process(result)


def fit_elastic_run(tmp_path, strategy: str, hosts: str, *rebuild_kill: str) -> tuple[subprocess.CompletedProcess,
                                                                                      dict]:
    """workers/lightning_elastic.py on 2 emulated nodes of 2 ranks with no slot to spare, node 1 killed as step 3
    starts, `hosts` written into the hosts file after step 4; its result (which must be there)."""
    rank = python_command(WORKERS / "lightning_elastic.py")  # warm: its newcomers start as the script says, cold
    env = child_env(FSDP_MPI_TIMEOUT="60", FSDP_MPI_EMULATED_NODE_SIZE="2")  # after python_command (run_mpi)
    command = [mpiexec(), *ULFM_LAUNCH.split()[1:], *only_these_slots(env, 4), "-x", "FSDP_MPI_TIMEOUT", "-x",
               "FSDP_MPI_EMULATED_NODE_SIZE", "-n", "4", *rank, str(tmp_path), strategy, "2,3", "3", "4", hosts, *rebuild_kill]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    said = run.stdout + run.stderr
    assert (tmp_path / "result.json").exists(), said[-4000:]
    assert "no newcomer can start in the place of rank(s) 2, 3 (2 free slot(s) needed, 0 in the allocation)" in said
    return run, json.loads((tmp_path / "result.json").read_text())


def assert_trains_as_one_process(result: dict) -> None:
    """Every step's loss, and the final weights, are plain torch's in one process, within the bounds below."""
    # 6 SGD steps (lr 0.1, momentum 0.9) on the whole dataset of 12 samples each step, as the reference. Each
    # gradient is a mean over 12 samples taken in another order (on 4, 2 or 1 ranks), so it differs by at most 12
    # float32 roundings of its norm; momentum carries a step's gradient into later updates with total weight
    # below 1 + 1.9 + 2.71 + 3.44 + 4.10 + 4.69 < 18, and each of the 6 updates rounds the weight once. A
    # checkpoint round trip (resharded from 4 ranks to 2 or 1 and back) moves no bit.
    lr, eps, parameters = 0.1, FP32_EPS, 2 * (8 * 8 + 8) + 8 + 1
    largest_gradient = max(result["gradient_norms"])
    weights_bound = lr * 18 * 12 * eps * largest_gradient + 6 * eps * result["scale"]
    assert result["weight_difference"] <= weights_bound
    # A loss differs by its own rounding (a mean of 12 squares, then of the ranks' means) and by the weights'
    # difference times the gradient (at most sqrt(parameters) x the largest element's difference).
    for loss, reference in zip(result["losses"], result["reference_losses"]):
        assert abs(loss - reference) <= 16 * eps * reference + largest_gradient * parameters ** 0.5 * weights_bound
    assert result["reference_losses"][-1] < result["reference_losses"][0] - 0.1  # it learns: every update shows


def test_the_requeue_follows_slurms_environment_and_says_when_scontrol_fails(tmp_path, monkeypatch):
    """lightning_requeue.py in this process: which signal a run asks to be requeued on (the Trainer's
    SLURMEnvironment plugin's, a batch job's default, none where auto-requeue is off or the signal is handled
    already), and what rank 0 says where the job cannot be requeued."""
    import signal
    from types import SimpleNamespace

    from lightning.pytorch.plugins.environments import SLURMEnvironment

    from fsdp_mpi.lightning_requeue import requeue, requeue_signal

    def asked(plugin=None):
        return requeue_signal(SimpleNamespace(_accelerator_connector=SimpleNamespace(_cluster_environment_flag=plugin)))

    for name in ("SLURM_NTASKS", "SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_JOB_NAME"):
        monkeypatch.delenv(name, raising=False)
    assert asked() is None  # not a batch job, and no plugin
    assert asked(SLURMEnvironment(requeue_signal=signal.SIGUSR2)) == signal.SIGUSR2
    assert asked(SLURMEnvironment(auto_requeue=False)) is None
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert asked() == signal.SIGUSR1  # as Lightning detects a batch job, without building its environment
    monkeypatch.setenv("SLURM_JOB_NAME", "interactive")
    assert asked() is None
    monkeypatch.delenv("SLURM_NTASKS")  # built with it, Lightning's environment would refuse srun's --ntasks
    usual = SLURMEnvironment()
    assert asked(usual) == signal.SIGUSR1
    monkeypatch.setattr(signal, "getsignal", lambda number: signal.SIG_IGN)  # the experiments ignore it
    assert asked(usual) is None

    assert requeue().startswith("not a SLURM job, so nothing is requeued")
    scontrol = tmp_path / "scontrol"
    scontrol.write_text('#!/bin/sh\necho "requeue of $2 not allowed" >&2\nexit 1\n')
    scontrol.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert requeue() == ("could not requeue job 77_3 (requeue of 77_3 not allowed; #SBATCH --requeue allows it): "
                         "submit the job again, and it resumes from that file")

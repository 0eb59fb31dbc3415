"""Experiments stopped by a signal and resumed from their checkpoints: the same numbers as a run never stopped.

The runs go under mpiexec; the pytest process only sends signals and reads the CSVs
and checkpoints (``consolidate_checkpoint`` needs no MPI).
"""

import contextlib
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from experiment_runs import EXPERIMENTS, QUICK, SHARED_DATA, launch, needs_data, read_rows
from mpi_launch import check_ok, child_env, mpiexec
from training.resume import FORMAT, STOPPED_WITH_CHECKPOINT, STOPPED_WITHOUT_CHECKPOINT, ResumeError, RunCheckpoints
from test_checkpoint import assert_same_parameters_and_optimizer_state

from fsdp_mpi import consolidate_checkpoint

# BERT, for its dropout: a resumed rank must draw the masks it would have drawn. 8 steps of about 0.3 s
# leave time for a signal sent after the first checkpoint to arrive well before the end.
BERT_STEPS_PER_EPOCH = 4
BERT = [*QUICK, "--steps-per-epoch", BERT_STEPS_PER_EPOCH]
BERT_TOTAL_STEPS = 2 * BERT_STEPS_PER_EPOCH
DROPOUT = ["--dropout", "0.1"]  # GPT-2's quick configuration has none
STOP_LINE = re.compile(r"stopped by SIGUSR1 after optimizer step (\d+) of (\d+)")


class Started:
    """An experiment on 2 ranks, started without waiting; its output goes to files (an unread pipe could block it).
    Its ranks import this checkout's fsdp_mpi (child_env), as a mutant's copy needs."""

    def __init__(self, script: str, out: Path, *args):
        self.script = script
        env = child_env(FSDP_MPI_DATA_DIR=str(SHARED_DATA))
        self.stdout, self.stderr = out / "stdout.txt", out / "stderr.txt"
        with open(self.stdout, "w") as stdout, open(self.stderr, "w") as stderr:
            self.process = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, str(EXPERIMENTS / script),
                                             *map(str, args)], env=env, stdout=stdout, stderr=stderr)

    def wait_until(self, ready, timeout: float = 120) -> None:
        """Polls `ready()` until it holds; fails if the run ends first or takes longer than `timeout`."""
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.process.poll() is None, f"ended first (exit {self.process.returncode}):\n{self.output()}"
            assert time.monotonic() < deadline, f"not ready after {timeout} s:\n{self.output()}"
            time.sleep(0.02)

    def rank_pids(self) -> list[int]:
        """The ranks' processes: hydra starts each in a session of its own, so they are found as descendants."""
        found, parents = [], [self.process.pid]
        while parents:
            try:
                tasks = list(Path(f"/proc/{parents.pop()}/task").iterdir())
            except (FileNotFoundError, ProcessLookupError):
                continue  # ended meanwhile
            for task in tasks:
                try:
                    children = [int(pid) for pid in (task / "children").read_text().split()]
                    parents += children
                    found += [pid for pid in children
                              if self.script.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()]
                except (FileNotFoundError, ProcessLookupError):
                    continue  # ended meanwhile
        return found

    def signal_ranks(self, number: int) -> None:
        for pid in self.rank_pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, number)

    def finish(self, timeout: float = 120) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            if self.process.poll() is None:
                self.signal_ranks(signal.SIGKILL)
                self.process.kill()

    def output(self) -> str:
        return f"stdout:\n{self.stdout.read_text()}\nstderr:\n{self.stderr.read_text()[-3000:]}"


def step_directories(root: Path) -> list[str]:
    return sorted(path.name for path in root.glob("step-*"))


def assert_same_training_state(ours: dict, reference: dict) -> None:
    """Two consolidated checkpoints hold the same parameters, AdamW state and schedule, bit for bit."""
    assert_same_parameters_and_optimizer_state(ours, reference)
    assert ours["extra"]["schedule"] == reference["extra"]["schedule"]


@needs_data
@pytest.mark.one_mpi  # the signal goes to a rank's own process, not through the launcher; the rest is ours
def test_a_run_stopped_by_a_signal_on_one_rank_and_resumed_ends_as_if_never_stopped(tmp_path):
    # Never stopped; --resume with an empty --checkpoint-dir starts fresh and says so.
    whole = launch("run_bert.py", 2, *BERT, "--out-dir", tmp_path / "whole-csv", "--checkpoint-dir",
                   tmp_path / "whole", "--resume")
    check_ok(whole)
    assert f"--resume: no checkpoint in {tmp_path / 'whole'} yet; starting fresh" in whole.stdout
    assert step_directories(tmp_path / "whole") == [f"step-{BERT_TOTAL_STEPS:08d}"]

    # The same run, sent SIGUSR1 on one rank once its first checkpoint is complete: the ranks agree on a step.
    parts, csv_dir = tmp_path / "parts", tmp_path / "parts-csv"
    (tmp_path / "stopped").mkdir()
    started = Started("run_bert.py", tmp_path / "stopped", *BERT, "--out-dir", csv_dir, "--checkpoint-dir", parts,
                      "--checkpoint-every", 1)
    started.wait_until(lambda: (parts / "latest").exists())
    ranks = started.rank_pids()
    assert len(ranks) == 2
    os.kill(ranks[-1], signal.SIGUSR1)
    # Once stopped, the ranks exit with STOPPED_WITH_CHECKPOINT even when SIGTERM keeps coming as they finalize,
    # as srun's (--kill-on-bad-exit) does to the others when the first one exits.
    started.wait_until(lambda: STOP_LINE.search(started.stdout.read_text()))
    while started.process.poll() is None:
        started.signal_ranks(signal.SIGTERM)
        time.sleep(0.002)
    assert started.finish() == STOPPED_WITH_CHECKPOINT, started.output()
    stop = STOP_LINE.search(started.stdout.read_text())
    assert stop and int(stop[2]) == BERT_TOTAL_STEPS, started.output()
    step = int(stop[1])
    assert f"checkpoint in {parts / f'step-{step:08d}'}: run the same command with --resume" in stop.string
    assert (parts / "latest").read_text() == f"step-{step:08d}\n"
    assert step_directories(parts) == [f"step-{s:08d}" for s in (step - 1, step) if s > 0]  # the newest 2 kept
    assert len(read_rows(csv_dir)) == (step - 1) // BERT_STEPS_PER_EPOCH  # the epochs validated before the stop

    # A resume with other options is refused, and changes nothing.
    refused = launch("run_bert.py", 2, *BERT, "--seed", 1, "--out-dir", csv_dir, "--checkpoint-dir", parts, "--resume")
    assert refused.returncode == 2 and "--seed 0 (now 1); resume with the same ones" in refused.stderr
    assert (parts / "latest").read_text() == f"step-{step:08d}\n"

    resumed = launch("run_bert.py", 2, *BERT, "--out-dir", csv_dir, "--checkpoint-dir", parts, "--checkpoint-every", 1,
                     "--resume")
    check_ok(resumed)
    assert f"resuming from {parts / f'step-{step:08d}'}: epoch {(step - 1) // BERT_STEPS_PER_EPOCH}, " \
           f"after optimizer step {step} of {BERT_TOTAL_STEPS}" in resumed.stdout
    assert step_directories(parts) == [f"step-{s:08d}" for s in (BERT_TOTAL_STEPS - 1, BERT_TOTAL_STEPS)]

    # Every epoch's row, also one trained partly before the stop, and the final state, bit for bit.
    expected, rows = read_rows(tmp_path / "whole-csv"), read_rows(csv_dir)
    assert len(rows) == len(expected) == 2 and rows[0]["run_id"] == rows[1]["run_id"]
    for row, reference in zip(rows, expected):
        for column in ("epoch", "steps", "train_loss", "val_loss", "val_mlm_accuracy", "val_nsp_accuracy"):
            assert row[column] == reference[column], column
    # Every optimizer step's row too, those before the stop kept in the checkpoint.
    expected, rows = read_rows(tmp_path / "whole-csv", per="step"), read_rows(csv_dir, per="step")
    assert [row["step"] for row in rows] == [str(step) for step in range(1, BERT_TOTAL_STEPS + 1)]
    assert [(row["epoch"], row["train_loss"]) for row in rows] == [(ref["epoch"], ref["train_loss"]) for ref in expected]
    final = f"step-{BERT_TOTAL_STEPS:08d}"
    assert_same_training_state(consolidate_checkpoint(parts / final),
                               consolidate_checkpoint(tmp_path / "whole" / final))


@needs_data
def test_a_signal_without_a_checkpoint_dir_stops_between_steps_with_the_rows_so_far(tmp_path):
    # mpiexec (MPICH's hydra) passes SIGUSR1 on to every rank. 2 x 150 steps of about 10 ms: the signal,
    # sent once epoch 0 is done, lands in epoch 1.
    started = Started("run_gpt2.py", tmp_path, *QUICK, "--steps-per-epoch", 150, "--out-dir", tmp_path / "csv")
    started.wait_until(lambda: "epoch 0:" in started.stdout.read_text())
    started.process.send_signal(signal.SIGUSR1)
    assert started.finish() == STOPPED_WITHOUT_CHECKPOINT, started.output()
    stop = STOP_LINE.search(started.stdout.read_text())
    assert stop and 150 < int(stop[1]) <= int(stop[2]) == 300, started.output()
    assert "without a checkpoint (no --checkpoint-dir): it cannot continue (exit code 4)" in stop.string
    assert [row["epoch"] for row in read_rows(tmp_path / "csv")] == ["0"]
    assert "Traceback" not in started.stderr.read_text()


@needs_data
@pytest.mark.parametrize("args,message", [
    (["--strategy", "ddp", "--checkpoint-dir", "{tmp}/ck"], "--checkpoint-dir needs --strategy fsdp-mpi"),
    (["--strategy", "lightning-ddp", "--checkpoint-dir", "{tmp}/ck"], "--checkpoint-dir needs --strategy fsdp-mpi"),
    (["--resume"], "--resume and --checkpoint-every need --checkpoint-dir"),
    (["--checkpoint-dir", "{tmp}/full"], "{tmp}/full already holds checkpoints: pass --resume"),
])
@pytest.mark.one_mpi  # options refused before any training
def test_checkpoint_options_that_cannot_work_fail_cleanly(tmp_path, args, message):
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "latest").write_text("step-00000003\n")
    result = launch("run_gpt2.py", 2, *[arg.format(tmp=tmp_path) for arg in args], "--out-dir", tmp_path, timeout=120)
    assert result.returncode == 2
    assert message.format(tmp=tmp_path) in result.stderr and "Traceback" not in result.stderr
    assert not list(tmp_path.glob("*.csv")) and not (tmp_path / "ck").exists()


@pytest.mark.one_mpi
def test_a_checkpoint_of_another_run_state_format_is_refused_with_a_message(tmp_path):
    run = SimpleNamespace(config=SimpleNamespace(checkpoint_dir=tmp_path), comm=None)
    for saved in ({}, {"format": FORMAT + 1}):  # before formats were numbered (1), and a newer one
        with pytest.raises(ResumeError, match=f"another version of the experiments .*this version reads {FORMAT}"):
            RunCheckpoints(run)._check_same_run(tmp_path / "step-00000001", saved)


@needs_data
@pytest.mark.one_mpi  # the experiments' bookkeeping; the resharding itself is test_checkpoint's
def test_a_run_saved_on_two_ranks_continues_on_one_and_on_three_at_the_same_sample(tmp_path):
    """GPT-2 with dropout 0.1 trained 2 epochs of 3 steps on 2 ranks, checkpointed after step 3; that checkpoint
    resumed on 1 and on 3 ranks trains epoch 1 on the same global batches with the same dropout masks (drawn per
    sample): every step's loss, the validation and the parameters those of the run never stopped, up to the
    rounding of other sums over other ranks."""
    whole = tmp_path / "whole"
    check_ok(launch("run_gpt2.py", 2, *QUICK, *DROPOUT, "--out-dir", tmp_path / "whole-csv", "--checkpoint-dir", whole,
                    "--checkpoint-every", 3))
    assert step_directories(whole) == ["step-00000003", "step-00000006"]
    reference_steps, reference_rows = read_rows(tmp_path / "whole-csv", per="step"), read_rows(tmp_path / "whole-csv")
    reference = consolidate_checkpoint(whole / "step-00000006")
    saved = consolidate_checkpoint(whole / "step-00000003")
    for ranks in (1, 3):
        parts = tmp_path / f"on-{ranks}"
        parts.mkdir()
        shutil.copytree(whole / "step-00000003", parts / "step-00000003")
        shutil.copy(whole / "run.json", parts / "run.json")
        (parts / "latest").write_text("step-00000003\n")
        resumed = launch("run_gpt2.py", ranks, *QUICK, *DROPOUT, "--out-dir", tmp_path / f"on-{ranks}-csv",
                         "--checkpoint-dir", parts, "--resume")
        check_ok(resumed)
        assert f"after optimizer step 3 of 6 (saved on 2 ranks, now {ranks})" in resumed.stdout
        steps, rows = read_rows(tmp_path / f"on-{ranks}-csv", per="step"), read_rows(tmp_path / f"on-{ranks}-csv")
        # The CSVs continue the run: its id, the steps trained on 2 ranks as saved, the rest on these.
        assert [row["run_id"] for row in rows] == [reference_rows[0]["run_id"]] * 2
        assert [row["world_size"] for row in steps] == ["2"] * 3 + [str(ranks)] * 3
        assert [row["global_batch"] for row in rows] == [reference_rows[0]["global_batch"]] * 2
        assert steps[:3] == reference_steps[:3] and rows[0]["train_loss"] == reference_rows[0]["train_loss"]
        assert [(row["step"], row["samples"]) for row in steps] == [(r["step"], r["samples"]) for r in reference_steps]
        # A step's loss is a float32 mean over its 8 x 32 tokens: summed in another order over other ranks it may
        # move by n u |L|, then the CSV rounds it to 5 decimals. Other samples would move it by far more.
        tokens, u = 8 * 32, 2.0**-24
        for row, expected in zip(steps[3:] + rows, reference_steps[3:] + reference_rows):
            for column in ("train_loss", "val_loss"):
                if column in row:
                    bound = tokens * u * abs(float(expected[column])) + 1e-5
                    assert abs(float(row[column]) - float(expected[column])) <= bound, (ranks, column, row)
        # Parameters: AdamW's normalised step carries rounding differences of the gradient (a gradient that is
        # mathematically zero, an attention key bias's) into moves of up to its largest step, so after the 3
        # steps on other ranks an element lies within 2 x the sum of those steps' reach of the run never stopped.
        reach = 2 * sum(adam_step_bound(step) for step in (4, 5, 6)) * max(
            group["initial_lr"] for group in saved["optimizer"]["param_groups"])
        final = consolidate_checkpoint(parts / "step-00000006")
        for name, value in final["model"].items():
            assert (value - reference["model"][name]).abs().max().item() <= reach, (ranks, name)


def adam_step_bound(step: int, beta1: float = 0.9, beta2: float = 0.999) -> float:
    """The largest |m_hat / sqrt(v_hat)| of Adam's step number `step` for any gradients (Cauchy-Schwarz over the
    moments' sums): how far, in learning rates, one step can move an element."""
    spread = sum((beta1**2 / beta2) ** k for k in range(step))
    return (1 - beta1) / math.sqrt(1 - beta2) * math.sqrt(spread) * math.sqrt(1 - beta2**step) / (1 - beta1**step)

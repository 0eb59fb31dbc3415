"""A lost rank does not end the job (--keep-going, Open MPI's ULFM): the survivors finish the run, and every step
after the loss computes what a run that lost nothing computes.

Ranks are SIGKILLed (tests/workers/keep_going.py) in a step's forward, in its backward, inside a gradient
reduce-scatter, while the survivors of an earlier loss rebuild, and on two emulated nodes at once (one of them
whole). The reference is one process on the same global batch: N ranks equal one process (test_equivalence), the
global batch stays the one the run started with, and dropout follows the sample, so a run that loses ranks must
end where an unbroken one ends; for 16-bit runs, with no bound, the same run resumed on its survivors.
"""

import os
import re
import subprocess

import pytest
from experiment_runs import EXPERIMENTS, SHARED_DATA, launch, needs_data, read_rows
from mpi_launch import WORKERS, RunFailed, child_env, mpiexec, only_these_slots, python_command
from test_experiments import SAME_TRAINING

from fsdp_mpi import continuation_unavailable

ULFM = ["--with-ft", "ulfm", "--mca", "btl", "tcp,self"]  # as failures/lost_ranks.ULFM_LAUNCH says
RUN = ["--model", "gpt2-tiny", "--device", "cpu", "--epochs", "2", "--steps-per-epoch", "4", "--seq-len", "32",
       "--val-steps", "2", "--no-progress"]
LOST = re.compile(r"--keep-going: lost rank\(s\) ([\d, ]+) of the job \((\d+) training before\); (\d+) rank\(s\)"
                  r"(?:, newcomers in rank\(s\) [\d, ]+,)? go on from (memory|the latest checkpoint)[^;]*? at optimizer step (\d+)\. Noticed after ([\d.]+) s in a "
                  r"collective, shrunk in ([\d.]+) s, rebuilt in ([\d.]+) s")
WATCHDOG_SECONDS = "60"  # a survivor left waiting fails the test with the watchdog's report, not the pytest timeout


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The unbroken run on one process, per global batch: {global batch: its step rows, its epoch rows}."""
    runs = {}
    for global_batch in (8, 12):
        out = tmp_path_factory.mktemp(f"one_process_{global_batch}")
        result = launch("run_gpt2.py", 1, *RUN, "--batch-size", global_batch, "--out-dir", out)
        assert result.returncode == 0, result.stderr[-3000:]
        runs[global_batch] = read_rows(out, per="step"), read_rows(out)
    return runs


def run_killing(nprocs: int, kills: list[str], *options, env: dict | None = None, keep_going: bool = True,
                slots: int | None = None, hosts_after: str | None = None) -> subprocess.CompletedProcess:
    """run_gpt2.py on `nprocs` ranks under ULFM, with --keep-going unless told, killing ranks as `kills`
    (RANK:STEP:MOMENT). `slots`: the processes the job may run, newcomers included (None: as many as asked for,
    as CI's oversubscribing policy lets Open MPI). `hosts_after`: STEP:HOST:SLOTS, written into the --add-hosts
    file once that step is done."""
    rank = python_command(WORKERS / "keep_going.py")  # warm: its newcomers start as the script says, cold
    env = child_env(FSDP_MPI_DATA_DIR=str(SHARED_DATA), FSDP_MPI_TIMEOUT=WATCHDOG_SECONDS, **(env or {}))
    exported = [word for name in ("FSDP_MPI_TIMEOUT", "FSDP_MPI_EMULATED_NODE_SIZE", "FSDP_MPI_DATA_DIR")
                if name in env for word in ("-x", name)]
    if slots is not None:
        exported += only_these_slots(env, slots)
    killing = [word for kill in kills for word in ("--kill", kill)] + (["--hosts-after", hosts_after] if hosts_after
                                                                       else [])
    command = [mpiexec(), *ULFM, *exported, "-n", str(nprocs), *rank, *killing, "--", *RUN, *(["--keep-going"] if keep_going else []), *map(str, options)]
    try:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=EXPERIMENTS)
    except subprocess.TimeoutExpired as hung:  # say where it hung: the survivors' last lines
        tails = [(text or b"").decode(errors="replace")[-4000:] for text in (hung.stdout, hung.stderr)]
        raise RunFailed(f"still running after 240 s\nstdout:\n{tails[0]}\nstderr:\n{tails[1]}") from None


def recoveries(result: subprocess.CompletedProcess) -> list[tuple]:
    """Each recovery's (lost job ranks, ranks before, ranks after, from where, step), and its times printed."""
    found = LOST.findall(result.stdout)
    for *_, noticed, shrunk, rebuilt in found:
        print(f"recovery: noticed after {noticed} s, shrunk in {shrunk} s, rebuilt in {rebuilt} s")
    return [(lost, int(before), int(after), source, int(step)) for lost, before, after, source, step, *_ in found]


def assert_ends_where_one_process_ends(out, reference) -> None:
    steps, epochs = read_rows(out, per="step"), read_rows(out)
    reference_steps, reference_epochs = reference
    assert [row["step"] for row in steps] == [row["step"] for row in reference_steps]
    for row, ref in zip(steps, reference_steps):
        assert float(row["train_loss"]) == pytest.approx(float(ref["train_loss"]), abs=SAME_TRAINING), row["step"]
    for row, ref in zip(epochs, reference_epochs, strict=True):
        assert float(row["train_loss"]) == pytest.approx(float(ref["train_loss"]), abs=SAME_TRAINING)
        assert float(row["val_loss"]) == pytest.approx(float(ref["val_loss"]), abs=SAME_TRAINING)


def shared_memory_files() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


@pytest.mark.open_mpi
@needs_data
def test_full_shard_survivors_reload_the_checkpoint_and_end_where_one_process_ends(one_process, tmp_path):
    """4 ranks, FULL_SHARD, a checkpoint every step: rank 1 dies inside a reduce-scatter; then rank 2 in a backward,
    and rank 0 (which writes the CSVs) while the survivors rebuild after that. Each time the survivors reload the
    latest checkpoint resharded onto their number, in the same processes, down to one."""
    before = shared_memory_files()
    result = run_killing(4, ["1:1:reduce_scatter", "2:3:backward", "0:3:rebuild"], "--batch-size", 2,
                         "--checkpoint-dir", tmp_path / "checkpoints", "--checkpoint-every", 1,
                         "--out-dir", tmp_path / "out")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert recoveries(result) == [("1", 4, 3, "the latest checkpoint", 1),
                                  ("0, 2", 3, 1, "the latest checkpoint", 3)]
    assert [row["world_size"] for row in read_rows(tmp_path / "out", per="step")] == list("43311111")
    assert_ends_where_one_process_ends(tmp_path / "out", one_process[8])
    assert shared_memory_files() <= before  # the node transport's segments went with the processes
    # The old run freed as the recovery ends (its model, communicator and node memory), not when Python next
    # collects its cycles: on the 3 survivors of the first loss, and the one of the second.
    alive = re.findall(r"the run before the loss alive at the next step: (\w+)", result.stdout)
    assert alive == ["False"] * 4, result.stdout[-3000:]


@pytest.mark.open_mpi
@needs_data
@pytest.mark.parametrize("precision, compression", [("16-mixed", "int8/bf16"), ("bf16-mixed", "none")])
def test_a_16_bit_run_goes_on_after_each_loss_to_the_digit_as_its_survivors_resumed_from_the_same_checkpoint(
        precision, compression, tmp_path):
    """3 ranks, FULL_SHARD, a checkpoint every step, 16-bit compute: fp16 with its loss scaler's found-inf
    reduction and int8 weights and bf16 gradients on the wire; bf16. Rank 2 dies in step 3's backward, rank 1
    in step 6's. No bound is needed: the same run ended by the first loss, then started again on its 2
    survivors with --resume from the checkpoint they reloaded (and itself going on after the second loss),
    must write the same rows to the CSV's last digit: a reload in the same processes is a resume."""
    options = ["--batch-size", 2, "--precision", precision, "--comm-compression", compression,
               "--checkpoint-every", 1]
    going_on = run_killing(3, ["2:3:backward", "1:6:backward"], *options, "--checkpoint-dir",
                           tmp_path / "checkpoints", "--out-dir", tmp_path / "out")
    assert going_on.returncode == 0, going_on.stdout[-3000:] + going_on.stderr[-3000:]
    assert recoveries(going_on) == [("2", 3, 2, "the latest checkpoint", 3), ("1", 2, 1, "the latest checkpoint", 6)]
    ended = run_killing(3, ["2:3:backward"], *options, "--checkpoint-dir", tmp_path / "resumed_checkpoints",
                        "--out-dir", tmp_path / "resumed", keep_going=False)
    # Each survivor ends itself with status 1 (failures/abort.py): an MPI_Abort here left mpirun waiting minutes.
    assert ended.returncode == 1 and "killed in step 3's backward" in ended.stdout, ended.stdout[-3000:]
    resumed = run_killing(2, ["1:6:backward"], *options, "--checkpoint-dir", tmp_path / "resumed_checkpoints",
                          "--out-dir", tmp_path / "resumed", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resuming from" in resumed.stdout and recoveries(resumed) == [("1", 2, 1, "the latest checkpoint", 6)]
    kept = {"step": ("step", "world_size", "samples", "train_loss"),
            "epoch": ("epoch", "world_size", "train_loss", "val_loss", "val_perplexity")}
    for per, columns in kept.items():
        rows = [[{column: row[column] for column in columns} for row in read_rows(tmp_path / out, per=per)]
                for out in ("out", "resumed")]
        assert rows[0] == rows[1], per
    assert [row["world_size"] for row in read_rows(tmp_path / "out", per="step")] == list("33322211")


@pytest.mark.open_mpi
@needs_data
def test_hybrid_shard_goes_on_from_the_node_left_whole_when_two_nodes_are_hit_and_grows_back_into_a_host_added(
        one_process, tmp_path):
    """6 ranks as 3 emulated nodes of 2, HYBRID_SHARD by node, no checkpoints at all, --grow-back with no slot to
    spare: in the same forward, one rank of the first node dies and both ranks of the second. No newcomer can
    start (the second node's would need free slots), so the node left whole goes on from its own memory, the first node's other
    rank leaves, and the global batch is kept. Once step 4 is done a host is added (this machine, 4 slots more
    than the 6 taken): at step 5's agreement 4 newcomers start in ranks 0 to 3, each healed by its twin on the
    third node, and the last steps train on 6 ranks again."""
    hosts = tmp_path / "hosts"
    # The 4 newcomers inherit mpirun's --bind-to none: bound to a core each by default, 2 cores refuse them.
    result = run_killing(6, ["1:2:forward", "2:2:forward", "3:2:forward"], "--batch-size", 2,
                         "--sharding-strategy", "HYBRID_SHARD", "--out-dir", tmp_path, "--grow-back", "--add-hosts",
                         hosts, env={"FSDP_MPI_EMULATED_NODE_SIZE": "2", "PRTE_MCA_rmaps_default_inherit": "1"},
                         slots=6, hosts_after="4:localhost:10")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert recoveries(result) == [("1, 2, 3", 6, 2, "memory", 2)]
    # Rank 1's newcomer would start on its node's host (rank 0 is alive there); the second node's need free slots.
    assert "no newcomer can start in the place of rank(s) 1, 2, 3 (2 free slot(s) needed, 0" in result.stderr
    assert "rank 0: left the run at optimizer step 2" in result.stdout
    assert ("--keep-going: hosts were added: grown back from 2 to 6 rank(s), newcomers in rank(s) 0, 1, 2, 3, going "
            "on from memory (each newcomer's state sent by its twin) at optimizer step 5") in result.stdout
    assert "resuming from" not in result.stdout
    assert [row["world_size"] for row in read_rows(tmp_path, per="step")] == list("66222666")
    assert_ends_where_one_process_ends(tmp_path, one_process[12])


@pytest.mark.open_mpi
@needs_data
def test_hybrid_shard_grows_back_a_lost_node_from_spare_slots_within_the_step(one_process, tmp_path):
    """4 ranks as 2 emulated nodes of 2, HYBRID_SHARD by node, --grow-back, 2 slots to spare: both ranks of the
    second node die in step 2's forward. Two newcomers start in the spare slots, in ranks 2 and 3, each healed by
    its twin on the first node, within the step: every step of the CSV trains on 4 ranks, as one process does."""
    result = run_killing(4, ["2:2:forward", "3:2:forward"], "--batch-size", 2, "--sharding-strategy",
                         "HYBRID_SHARD", "--grow-back", "--out-dir", tmp_path, env={"FSDP_MPI_EMULATED_NODE_SIZE": "2"},
                         slots=6)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert recoveries(result) == [("2, 3", 4, 4, "memory", 2)]
    assert "newcomers in rank(s) 2, 3, go on from memory (each newcomer's state sent by its twin)" in result.stdout
    for rank in (2, 3):
        assert f"--keep-going: rank {rank}: a newcomer in a lost rank's place, at optimizer step 2" in result.stdout
    assert [row["world_size"] for row in read_rows(tmp_path, per="step")] == list("44444444")
    assert_ends_where_one_process_ends(tmp_path, one_process[8])


@pytest.mark.open_mpi
@needs_data
def test_no_shard_goes_on_from_memory_after_each_of_two_losses_in_turn(one_process, tmp_path):
    """4 ranks, NO_SHARD (each rank a whole replica), no checkpoints at all: rank 3 dies in step 3's backward, rank
    1 in step 6's forward. Each time the survivors go on from their own memory, the second time from the state the
    first recovery moved, and the global batch of 12 is kept on 4, 3 and 2 ranks."""
    result = run_killing(4, ["3:3:backward", "1:6:forward"], "--batch-size", 3, "--sharding-strategy", "NO_SHARD",
                         "--out-dir", tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert [(lost, before, after, source) for lost, before, after, source, _ in recoveries(result)] == [
        ("3", 4, 3, "memory"), ("1", 3, 2, "memory")]
    assert "resuming from" not in result.stdout
    assert [row["world_size"] for row in read_rows(tmp_path, per="step")] == list("44433322")
    assert_ends_where_one_process_ends(tmp_path, one_process[12])


@pytest.mark.open_mpi
@needs_data
def test_losses_during_validation_and_during_the_reload_that_follows(one_process, tmp_path):
    """4 ranks, FULL_SHARD, a checkpoint every step, each step two micro-batches of 1 sample a rank accumulated
    without a reduction (--accum-no-sync): rank 3 dies in the validation at the first epoch's end; rank 2 while
    the survivors read the checkpoint to go on from. They shrink again inside the same recovery, reload it on 2
    ranks, validate the epoch again and end where one process ends."""
    result = run_killing(4, ["3:3:validation", "2:3:reload"], "--batch-size", 1, "--grad-accum", 2,
                         "--accum-no-sync", "--val-steps", 4,  # the reference's validation samples, 1 a batch
                         "--checkpoint-dir", tmp_path / "checkpoints", "--checkpoint-every", 1,
                         "--out-dir", tmp_path / "out")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert recoveries(result) == [("2, 3", 4, 2, "the latest checkpoint", 4)]
    assert [row["world_size"] for row in read_rows(tmp_path / "out", per="step")] == list("44442222")
    assert_ends_where_one_process_ends(tmp_path / "out", one_process[8])


@pytest.mark.open_mpi
@needs_data
def test_an_error_after_a_loss_is_said_by_a_survivor_and_ends_every_survivor(tmp_path):
    """3 ranks, FULL_SHARD: rank 0 (which speaks for the run) dies in a backward, and the checkpoint the survivors
    are about to reload turns out damaged. Rank 0 of the survivors says why and they end with exit code 2 (before,
    only the dead rank 0 would have said it, and the survivors could wait in MPI_Finalize)."""
    result = run_killing(3, ["0:1:backward", "1:1:damage"], "--batch-size", 2, "--checkpoint-dir",
                         tmp_path / "checkpoints", "--checkpoint-every", 1, "--out-dir", tmp_path / "out")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    said = [line for line in result.stderr.splitlines() if line.startswith("keep_going.py: error:")]  # the worker's name
    assert len(said) == 1 and "step-00000001" in said[0], result.stderr[-3000:]


def test_where_a_job_cannot_go_on_it_says_why(monkeypatch):
    """MPICH and Intel MPI cannot report a lost rank; Open MPI can only when started with ULFM and without its
    shared-memory transport, and not under srun."""
    from mpi4py import MPI

    monkeypatch.delenv("OMPI_MCA_mpi_ft_enable", raising=False)
    if "Open MPI" not in MPI.Get_library_version():
        assert re.match(r"(MPICH|Intel).* cannot report a lost rank", continuation_unavailable())
        return
    assert "start the job with `mpirun --with-ft ulfm --mca btl tcp,self`" in continuation_unavailable()
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    monkeypatch.delenv("PRTE_LAUNCHED", raising=False)
    assert "started by srun" in continuation_unavailable()
    monkeypatch.setenv("OMPI_MCA_mpi_ft_enable", "1")
    monkeypatch.setenv("OMPI_MCA_btl", "sm,self")
    assert "shared-memory transport cannot see a dead peer" in continuation_unavailable()
    monkeypatch.setenv("OMPI_MCA_btl", "tcp,self")
    assert continuation_unavailable() is None

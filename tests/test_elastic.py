"""fsdp_mpi.elastic under Open MPI's ULFM: a user's own loop (tests/workers/elastic_loop.py, a Hugging Face GPT-2
under ``run_elastic``) loses ranks at the moments a user can hit and ends where one process ends; the step
protocol holds at its edges (tests/workers/lost_ranks.py).

The reference is the same loop on one process: N ranks equal one process on the same global batch
(test_equivalence), every step's samples follow from the step, and the weights change only after the step's
agreement, so a run that loses ranks and goes back to its last commit or checkpoint must compute the same losses.
"""

import json
import subprocess
import sys

import pytest
from mpi_launch import WORKERS, RunFailed, child_env, mpiexec

ULFM = ["--with-ft", "ulfm", "--mca", "btl", "tcp,self"]  # as failures/lost_ranks.ULFM_LAUNCH says
# float32 losses near 4 (ulp 4.8e-7) through 6 AdamW steps whose gradients are summed in another order on 4,
# 3, 2 or 1 ranks: a few ulps per step, as test_experiments' SAME_TRAINING without the CSV's rounding.
SAME_LOSS = 2e-5


def run_loop(out, nprocs: int, *options, env: dict | None = None) -> subprocess.CompletedProcess:
    """elastic_loop.py on `nprocs` ranks (under ULFM where more than one), writing `out`/result.json."""
    out.mkdir(exist_ok=True)
    env = child_env(FSDP_MPI_TIMEOUT="60", **(env or {}))  # a survivor left waiting: the watchdog's report
    exported = [word for name in ("FSDP_MPI_TIMEOUT", "FSDP_MPI_EMULATED_NODE_SIZE") if name in env
                for word in ("-x", name)]
    command = [mpiexec(), *(ULFM if nprocs > 1 else []), *exported, "-n", str(nprocs), sys.executable,
               str(WORKERS / "elastic_loop.py"), str(out), *map(str, options)]
    try:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as hung:
        tails = [(text or b"").decode(errors="replace")[-4000:] for text in (hung.stdout, hung.stderr)]
        raise RunFailed(f"still running after 240 s\nstdout:\n{tails[0]}\nstderr:\n{tails[1]}") from None


def result_of(out, run: subprocess.CompletedProcess) -> dict:
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return json.loads((out / "result.json").read_text())


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = tmp_path_factory.mktemp("one_process")
    return result_of(out, run_loop(out, 1))


def assert_trains_as_one_process(result: dict, reference: dict) -> None:
    assert len(result["losses"]) == len(reference["losses"]) == 6
    assert result["losses"] == pytest.approx(reference["losses"], abs=SAME_LOSS)
    assert reference["losses"][-1] < reference["losses"][0] - 0.3  # it learns: every update shows
    assert result["held_out"] == pytest.approx(reference["held_out"], abs=SAME_LOSS)  # the last update too


def assert_nothing_piled_up(result: dict) -> None:
    """Three communicators were dropped on the way: their threads, files and shared memory went with them."""
    first, end = result["after_first_step"], result["at_the_end"]
    assert set(end["threads"]) <= set(first["threads"]), (first, end)
    assert end["files"] <= first["files"] and end["shared_mappings"] <= first["shared_mappings"], (first, end)


@pytest.mark.open_mpi
def test_a_users_loop_reloads_checkpoints_after_losses_in_the_found_inf_reduction_a_save_and_a_recovery(
        one_process, tmp_path):
    """FULL_SHARD on 4 ranks, a checkpoint every 2 steps: rank 3 dies in step 1's found-inf reduction, the
    collective before the agreement (the survivors reload
    the checkpoint the run saved as it started); rank 0 dies between renaming step 2's checkpoint and naming it
    ``latest``, and rank 2 while the survivors of that shrink: rank 1 alone reloads step 0 and trains to the end."""
    run = run_loop(tmp_path, 4, "--checkpoint-every", 2, "--kill", "3:1:unscale", "--kill", "0:2:latest",
                   "--kill", "2:2:recovery")
    result = result_of(tmp_path, run)
    assert [line.split(";")[0] for line in result["recoveries"]] == [
        "lost rank(s) 3 of the job (4 training before)", "lost rank(s) 0, 2 of the job (3 training before)"]
    assert "3 rank(s) go on from the latest checkpoint at optimizer step 0" in result["recoveries"][0]
    assert "1 rank(s) go on from the latest checkpoint at optimizer step 0" in result["recoveries"][1]
    assert result["ranks"] == 1
    assert_trains_as_one_process(result, one_process)
    assert_nothing_piled_up(result)


@pytest.mark.open_mpi
def test_hybrid_shard_goes_on_from_memory_then_from_a_checkpoint_when_no_group_is_left_whole(one_process, tmp_path):
    """HYBRID_SHARD on 2 emulated nodes of 2 ranks, a checkpoint every 2 steps: rank 1 dies as step 2's checkpoint
    is being saved (its node's rank 0 leaves; ranks 2 and 3 go on from their memory at step 2); then rank 3 dies
    inside step 3's agreement, no shard group is whole, and rank 2 reloads the latest checkpoint: the one the run
    saved as it started, step 2's having been cut short."""
    run = run_loop(tmp_path, 4, "--strategy", "HYBRID_SHARD", "--checkpoint-every", 2, "--kill", "1:2:save",
                   "--kill", "3:3:agreement", env={"FSDP_MPI_EMULATED_NODE_SIZE": "2"})
    result = result_of(tmp_path, run)
    assert "rank 0: left the run at optimizer step 2" in run.stdout
    assert [line.split(". Noticed")[0] for line in result["recoveries"]] == [
        "lost rank(s) 1 of the job (4 training before); 2 rank(s) go on from memory (the shard groups left whole) "
        "at optimizer step 2",
        "lost rank(s) 3 of the job (2 training before); 1 rank(s) go on from the latest checkpoint at optimizer "
        "step 0"]
    assert_trains_as_one_process(result, one_process)


@pytest.mark.open_mpi
def test_every_survivor_ends_the_step_in_one_agreement_and_a_real_error_after_a_loss_stays_an_error():
    command = [mpiexec(), *ULFM, "-n", "3", sys.executable, str(WORKERS / "lost_ranks.py")]
    run = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert sorted(line for line in run.stdout.splitlines() if "protocol holds" in line) == [
        "rank 0: protocol holds", "rank 1: protocol holds"]

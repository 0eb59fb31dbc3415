"""fsdp_mpi.elastic under Open MPI's ULFM: a user's own loop (tests/workers/elastic_loop.py, a Hugging Face GPT-2
under ``run_elastic``) loses ranks at the moments a user can hit and ends where one process ends; the step
protocol holds at its edges (tests/workers/lost_ranks.py).

The reference is the same loop on one process: N ranks equal one process on the same global batch
(test_equivalence), every step's samples follow from the step, and the weights change only after the step's
agreement, so a run that loses ranks and goes back to its last commit or checkpoint must compute the same losses.
"""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi_launch import WORKERS, RunFailed, child_env, mpiexec, only_these_slots, python_command

ULFM = ["--with-ft", "ulfm", "--mca", "btl", "tcp,self"]  # as failures/lost_ranks.ULFM_LAUNCH says


def same_loss(steps: int) -> float:
    """How far apart two float32 losses near 4 (ulp 4.8e-7) may be after `steps` AdamW steps whose gradients
    were summed in another order (on 4, 3, 2 or 1 ranks): a few ulps (6) per step, as test_experiments'
    SAME_TRAINING without the CSV's rounding."""
    return steps * 6 * 4.8e-7


SAME_LOSS = same_loss(6)  # elastic_loop.py's steps


def run_loop(out, nprocs: int, *options, env: dict | None = None,
             slots: int | None = None) -> subprocess.CompletedProcess:
    """elastic_loop.py on `nprocs` ranks (under ULFM where more than one), writing `out`/result.json. `slots`: the
    processes this machine may run in the job, newcomers included (None: as many as asked for, as CI's
    oversubscribing policy lets Open MPI)."""
    out.mkdir(exist_ok=True)
    rank = python_command(WORKERS / "elastic_loop.py")  # warm: its newcomers start as the script says, cold
    # After python_command (see mpi_launch.run_mpi); a survivor left waiting: the watchdog's report.
    env = child_env(FSDP_MPI_TIMEOUT="60", **(env or {}))
    exported = [word for name in ("FSDP_MPI_TIMEOUT", "FSDP_MPI_EMULATED_NODE_SIZE") if name in env
                for word in ("-x", name)]
    if slots is not None:
        exported += only_these_slots(env, slots)
    command = [mpiexec(), *(ULFM if nprocs > 1 else []), *exported, "-n", str(nprocs), *rank, str(out),
               *map(str, options)]
    try:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    except subprocess.TimeoutExpired as hung:
        tails = [(text or b"").decode(errors="replace")[-4000:] for text in (hung.stdout, hung.stderr)]
        raise RunFailed(f"still running after 240 s\nstdout:\n{tails[0]}\nstderr:\n{tails[1]}") from None


def result_of(out, run: subprocess.CompletedProcess, exit_code: int = 0) -> dict:
    assert run.returncode == exit_code, run.stdout[-3000:] + run.stderr[-3000:]
    # Not a given: under ULFM, Open MPI's mpirun exits 0 when a survivor calls MPI_Abort after rank 0 was lost.
    assert (out / "result.json").exists(), "no rank wrote the result\n" + run.stdout[-3000:] + run.stderr[-3000:]
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
    """The communicators of the ranks before each loss were dropped on the way, with their threads, files and
    shared memory: the end holds no more of each than the first step did. And at once: at the first step after
    each recovery, before Python's next full collection, the old runs' models are gone and the node memory
    mapped is no more than the first step's (the old communicator, which the loop may keep, holds none)."""
    first, end = result["after_first_step"], result["at_the_end"]
    assert set(end["threads"]) <= set(first["threads"]), (first, end)
    for kind in ("files", "shared_mappings", "communicators"):
        assert end[kind] <= first[kind], (kind, first, end)
    assert result["after_recoveries"] and len(result["after_recoveries"]) <= len(result["recoveries"])
    for after in result["after_recoveries"]:
        assert after["old_models_alive"] == 0, (first, after)
        assert after["shared_mappings"] <= first["shared_mappings"], (first, after)


@pytest.mark.open_mpi
def test_a_users_loop_survives_losses_as_it_starts_in_the_found_inf_reduction_a_save_and_a_recovery(
        one_process, tmp_path):
    """FULL_SHARD on 5 ranks, a checkpoint every 2 steps: rank 4 dies as the run is first built (the others build
    it again on 4); rank 3 dies in step 1's found-inf reduction, the collective before the agreement (the
    survivors reload the checkpoint the run saved as it started); rank 0 dies between renaming step 2's
    checkpoint and naming it ``latest``, and rank 2 while the survivors of that shrink: rank 1 alone reloads
    step 0 and trains to the end."""
    run = run_loop(tmp_path, 5, "--checkpoint-every", 2, "--kill", "4:-1:start", "--kill", "3:1:unscale",
                   "--kill", "0:2:latest", "--kill", "2:2:recovery")
    result = result_of(tmp_path, run)
    assert "fsdp_mpi.elastic: lost rank(s) 4 of the job as the run was first built; 4 rank(s) build it again" \
        in run.stdout, run.stdout[-3000:]
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
    assert_nothing_piled_up(result)


@pytest.mark.open_mpi
def test_hybrid_shard_grows_back_after_each_loss_every_newcomer_healed_by_its_twin(one_process, tmp_path):
    """HYBRID_SHARD on 2 emulated nodes of 2 ranks, growing back, no checkpoints, no slot to spare: rank 1 dies in
    step 2's backward, and a newcomer starts in its place (on its node, which has a survivor), its shards and
    optimizer state sent by its twin (rank 3, the same place on the other node); then rank 3 dies inside step 4's
    agreement, and a second newcomer is healed by rank 1's newcomer. Every step trains on 4 ranks, as one process
    does, and the survivors pile nothing up."""
    run = run_loop(tmp_path, 4, "--strategy", "HYBRID_SHARD", "--grow-back", "--kill", "1:2:backward",
                   "--kill", "3:4:agreement", env={"FSDP_MPI_EMULATED_NODE_SIZE": "2"}, slots=4)
    result = result_of(tmp_path, run)
    assert [line.split(". Noticed")[0] for line in result["recoveries"]] == [
        f"lost rank(s) {lost} of the job (4 training before); 4 rank(s), newcomers in rank(s) {lost}, go on from "
        f"memory (each newcomer's state sent by its twin) at optimizer step {step}" for lost, step in ((1, 2), (3, 4))]
    for rank, step in ((1, 2), (3, 4)):
        assert (f"fsdp_mpi.elastic: rank {rank}: a newcomer in a lost rank's place, at optimizer step {step}, on "
                f"{socket.gethostname()}") in run.stdout, run.stdout[-3000:]
    assert result["step_ranks"] == [4] * 6
    assert_trains_as_one_process(result, one_process)
    assert_nothing_piled_up(result)


@pytest.mark.open_mpi
def test_a_node_lost_whole_with_no_free_slot_goes_on_shrunk_and_grows_back_once_a_host_is_added(
        one_process, tmp_path):
    """HYBRID_SHARD on 2 emulated nodes of 2 ranks, growing back, no slot to spare: both ranks of node 1 die as
    they enter step 2's agreement (where both surely get: in a backward, one may meet the other's loss first and
    live). Their newcomers would need free slots (their node is gone), so the survivors say so once and go on as
    without growing back: node 0, left whole, from its memory. The hosts file holds a line without its slots:
    read at steps 2 and 3, it is said to be unusable once. After step 3 a host is written into it (this
    machine's, with 2 slots more than the 4 taken): at step 4's agreement the ranks grow back into it, each
    newcomer healed by its twin, and take step 4 again on 4 ranks."""
    (tmp_path / "hosts").write_text("localhost\n")
    run = run_loop(tmp_path, 4, "--strategy", "HYBRID_SHARD", "--grow-back", "--kill", "2:2:agreement",
                   "--kill", "3:2:agreement", "--add-hosts", "4:localhost:6",
                   env={"FSDP_MPI_EMULATED_NODE_SIZE": "2"}, slots=4)
    result = result_of(tmp_path, run)
    assert run.stderr.count("fsdp_mpi.elastic: no newcomer can start") == 1, run.stderr[-3000:]
    assert ("fsdp_mpi.elastic: no newcomer can start in the place of rank(s) 2, 3 (2 free slot(s) needed, 0 in the "
            "allocation)") in run.stderr, run.stderr[-3000:]
    assert run.stderr.count("fsdp_mpi.elastic: the hosts file is not used: ") == 1, run.stderr[-3000:]
    assert f"{tmp_path / 'hosts'}, line 1: 'localhost' is not HOST:SLOTS" in run.stderr
    assert [line.split(". Noticed")[0].split(", in ")[0] for line in result["recoveries"]] == [
        "lost rank(s) 2, 3 of the job (4 training before); 2 rank(s) go on from memory (the shard groups left whole) "
        "at optimizer step 2",
        "hosts were added: grown back from 2 to 4 rank(s), newcomers in rank(s) 2, 3, going on from memory (each "
        "newcomer's state sent by its twin) at optimizer step 4"]
    assert result["step_ranks"] == [4, 4, 2, 2, 4, 4]
    assert_trains_as_one_process(result, one_process)
    assert_nothing_piled_up(result)


@pytest.mark.open_mpi
def test_full_shard_grows_back_from_the_checkpoint_and_a_newcomer_lost_as_it_joins_leaves_the_run_shrunk(
        one_process, tmp_path):
    """FULL_SHARD on 4 ranks, growing back, a checkpoint every 2 steps: rank 2 dies in step 1's backward, and the
    newcomer started in its place dies as it builds the run (a loss inside the grow-back): the survivors go on
    with 3 ranks from the checkpoint saved as the run started. Once 3 steps are committed a host is added to the
    hosts file: at step 3's agreement the 3 ranks save step 3 (the latest periodic checkpoint holds 2), a
    newcomer starts in rank 2's place, and the 4 ranks load it. Rank 1 then dies in step 4's backward, and its
    newcomer and the others reload step 4's checkpoint. mpirun then exits 137, as the first newcomer did: Open
    MPI 5.0.11's launcher forgives a lost process only in the job it launched itself, not in the one a spawn
    started (docs/failures.md)."""
    run = run_loop(tmp_path, 4, "--checkpoint-every", 2, "--grow-back", "--kill", "2:1:backward",
                   "--kill-newcomer", "2:-1:start", "--add-hosts", "3:localhost:8", "--kill", "1:4:backward")
    result = result_of(tmp_path, run, exit_code=128 + 9)
    assert [line.split(". Noticed")[0].split(", in ")[0] for line in result["recoveries"]] == [
        "lost rank(s) 2 of the job (4 training before); 3 rank(s) go on from the latest checkpoint at optimizer "
        "step 0",
        "hosts were added: grown back from 3 to 4 rank(s), newcomers in rank(s) 2, going on from a checkpoint "
        "saved at this step at optimizer step 3",
        "lost rank(s) 1 of the job (4 training before); 4 rank(s), newcomers in rank(s) 1, go on from the "
        "latest checkpoint at optimizer step 4"]
    assert "rank 2: killed in step -1's start" in run.stdout, run.stdout[-3000:]
    assert result["step_ranks"] == [3, 3, 3, 4, 4, 4]
    assert_trains_as_one_process(result, one_process)


@pytest.mark.open_mpi
@pytest.mark.parametrize("strategy", ["NO_SHARD", "SHARD_GRAD_OP"])
def test_losses_with_a_reduce_scatter_in_flight_and_inside_the_shrink_with_accumulation_and_offload(
        one_process, tmp_path, strategy):
    """3 ranks as 2 emulated nodes (ranks 0 and 1, rank 2), every step two micro-batches (the first under no_sync),
    prefetching, the reduce-scatter started asynchronously, the shards in host memory: rank 2 dies in step 3's
    backward, and rank 1 as the survivors start to shrink (rank 0 is inside MPI's shrink). Under NO_SHARD rank 0
    is a whole replica, and the run grows back from memory with 1 slot to spare: rank 1's newcomer on its node's
    host, in the dead process's place, rank 2's (its node is gone) in the free slot, two spawns in turn (the first
    newcomer taking part in the second), each healed by rank 0 within the step. Under SHARD_GRAD_OP, not growing
    back, rank 0 reloads step 2's checkpoint alone."""
    grow_back = strategy == "NO_SHARD"
    run = run_loop(tmp_path, 3, "--strategy", strategy, "--checkpoint-every", 2, "--accumulate", "--overlap",
                   "--offload", *["--grow-back"] * grow_back, "--kill", "2:3:backward", "--kill", "1:3:shrink",
                   **({"env": {"FSDP_MPI_EMULATED_NODE_SIZE": "2"}, "slots": 4} if grow_back else {}))
    result = result_of(tmp_path, run)
    going_on = ("3 rank(s), newcomers in rank(s) 1, 2, go on from memory (each newcomer's state sent by its twin) at "
                "optimizer step 3" if grow_back else "1 rank(s) go on from the latest checkpoint at optimizer step 2")
    assert [line.split(". Noticed")[0] for line in result["recoveries"]] == [
        f"lost rank(s) 1, 2 of the job (3 training before); {going_on}"]
    if grow_back:
        assert result["step_ranks"] == [3] * 6
        for rank in (1, 2):
            assert f"rank {rank}: a newcomer in a lost rank's place, at optimizer step 3" in run.stdout
    assert_trains_as_one_process(result, one_process)
    assert_nothing_piled_up(result)


@pytest.mark.open_mpi
def test_every_survivor_ends_the_step_in_one_agreement_and_a_real_error_after_a_loss_stays_an_error():
    command = [mpiexec(), *ULFM, "-n", "3", *python_command(WORKERS / "lost_ranks.py")]
    run = subprocess.run(command, env=child_env(), capture_output=True, text=True, timeout=120)
    assert sorted(line for line in run.stdout.splitlines() if "protocol holds" in line) == [
        "rank 0: protocol holds", "rank 1: protocol holds"], run.stdout[-3000:] + run.stderr[-3000:]
    # Then rank 0 died and rank 1 raised: the job fails, saying why, although rank 0 is gone.
    assert "RuntimeError: a survivor's own error after the job's rank 0 was lost" in run.stderr, run.stderr[-3000:]
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.open_mpi
def test_a_rank_lost_before_its_first_message_ends_the_job_at_once_naming_it():
    command = [mpiexec(), *ULFM, "-n", "3", *python_command(WORKERS / "lost_ranks.py"), "early"]
    started = time.monotonic()
    run = subprocess.run(command, env=child_env(FSDP_MPI_TIMEOUT="600"), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode != 0 and time.monotonic() - started < 60  # not the watchdog's 600 s
    assert "fsdp_mpi: rank(s) 2 of the job died as it started" in run.stderr, run.stderr[-3000:]


# Imported first by every rank of the docs' program: rank KILL_RANK of the job kills itself at the
# KILL_AT_HOOK-th unit hook of a backward, as a node that dies.
KILLER = """import os
import signal

import torch

if os.environ.get("OMPI_COMM_WORLD_RANK") == os.environ["KILL_RANK"]:
    from fsdp_mpi.communication import timing_points

    class Killer:
        hooks = 0

        def enter(self, point):
            if point == timing_points.HOOK and not torch.is_grad_enabled():  # autograd runs backward's hooks so
                self.hooks += 1
                if self.hooks == int(os.environ["KILL_AT_HOOK"]):
                    os.kill(os.getpid(), signal.SIGKILL)

        def leave(self, point):
            pass

        def collective_started(self, record):
            pass

    timing_points.add_listener(Killer())
"""


def docs_program() -> str:
    """The first Python block of docs/failures.md's "Your own loop"."""
    page = (Path(__file__).parents[1] / "docs" / "failures.md").read_text()
    return page.split("\n### Your own loop\n", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.open_mpi
def test_the_docs_program_runs_as_written_and_a_rank_lost_in_it_changes_no_loss(tmp_path):
    """docs/failures.md's program on one process, and on 3 ranks under ULFM with rank 1 killed in the backward of
    its second step (the seventh unit hook of a backward): the survivors reload the checkpoint the run saved as it
    started, and print the same 8 losses."""
    (tmp_path / "train.py").write_text(docs_program())
    (tmp_path / "killer").mkdir()
    (tmp_path / "killer" / "sitecustomize.py").write_text(KILLER)
    losses = {}
    for nprocs in (1, 3):
        folder = tmp_path / f"on_{nprocs}"
        folder.mkdir()
        env = child_env(KILL_RANK="1" if nprocs > 1 else "none", KILL_AT_HOOK="7", FSDP_MPI_TIMEOUT="60")
        env["PYTHONPATH"] = os.pathsep.join([str(tmp_path / "killer"), env["PYTHONPATH"]])
        command = [mpiexec(), *(ULFM if nprocs > 1 else []), "-x", "FSDP_MPI_TIMEOUT", "-n", str(nprocs),
                   sys.executable, str(tmp_path / "train.py")]
        run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180, cwd=folder)
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        said = [line.split()[1:] for line in run.stdout.splitlines() if line.startswith("losses ")]
        assert len(said) == 1, run.stdout[-3000:]
        losses[nprocs] = [float(loss) for loss in said[0]]
        if nprocs > 1:
            assert "fsdp_mpi.elastic: lost rank(s) 1 of the job (3 training before); 2 rank(s) go on from the " \
                   "latest checkpoint at optimizer step 0" in run.stdout, run.stdout[-3000:]
    assert len(losses[1]) == 8 and losses[1][-1] < losses[1][0] - 0.3  # it learns
    assert losses[3] == pytest.approx(losses[1], abs=same_loss(8) + 1e-6)  # printed to 6 decimals


@pytest.mark.one_mpi  # reads files: no MPI library's behaviour in it
@pytest.mark.one_rank
def test_a_hosts_file_is_read_as_host_slots_lines_and_what_cannot_be_used_is_said_once(tmp_path, capfd):
    """The hosts file a shrunk run grows back into: HOST:SLOTS lines with comments, handed to the launcher as one
    list; a missing or empty file adds nothing; a bad line or a file that cannot be read is named, said once
    while it stays so, and taken as no change; a growth tried is not tried again until the file changes. And a
    hosts file without grow_back is refused before anything starts."""
    import fsdp_mpi
    from fsdp_mpi.communication.failures import job

    hosts = tmp_path / "hosts"
    job.add_hosts_from(hosts)
    assert job.added_hosts() is None and not job.hosts_were_added()  # not written yet
    hosts.write_text("# spares\n\n")
    assert job.added_hosts() is None
    hosts.write_text("nodeC:4  # a spare node\nnodeD:2\n")
    assert job.added_hosts() == "nodeC:4,nodeD:2"
    assert job.hosts_were_added()
    job.hosts_tried()  # as a growth that could not be made leaves it
    assert not job.hosts_were_added()
    hosts.write_text("nodeC:4\nnodeD:2\nnodeE:0\n")
    for _ in range(2):
        assert not job.hosts_were_added()
    said = capfd.readouterr().err
    assert said.count("fsdp_mpi.elastic: the hosts file is not used: ") == 1, said
    assert f"{hosts}, line 3: 'nodeE:0' is not HOST:SLOTS" in said
    job.add_hosts_from(tmp_path)  # a directory: it cannot be read
    assert not job.hosts_were_added()
    assert f"{tmp_path} cannot be read (" in capfd.readouterr().err
    hosts.write_text("nodeC:4\nnodeE:1\n")
    job.add_hosts_from(hosts)
    assert job.hosts_were_added()  # changed since the growth tried
    with pytest.raises(ValueError, match="hosts_file is read to grow back into the hosts added: it needs "
                                         "grow_back=True"):
        fsdp_mpi.run_elastic(lambda state: None, lambda comm: None, hosts_file=hosts)


@pytest.mark.one_mpi  # the survivors' choice of places: no MPI in it
def test_newcomers_start_on_their_nodes_host_where_it_keeps_a_survivor_and_in_free_slots_first(monkeypatch):
    """Each newcomer's place, from the nodes heard (host, emulated block): on the host of the node of the rank it
    replaces where that node has a survivor (a spawn a host), else in free slots; the free slots spawned first (a
    spawn onto a host would take them), in the same order on every survivor whatever the order of the lost."""
    from fsdp_mpi.communication.failures import job

    nodes = {0: ("a", 0), 1: ("a", 0), 2: ("b", 0), 3: ("b", 0), 4: ("c", 0), 5: ("c", 0), 6: ("a", 1), 7: (None, 0)}
    monkeypatch.setattr(job, "node_of", nodes.get)
    assert job.places_of([5, 3, 1, 4], [0, 2]) == [([4, 5], None), ([1], "a"), ([3], "b")]
    assert job.places_of([1], [0]) == [([1], "a")]
    assert job.places_of([6, 7], [0, 1]) == [([6, 7], None)]  # another block on host a, and a host never heard

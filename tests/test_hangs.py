"""No silent hangs: ranks that diverge get a clear error, and a rank that dies ends the whole job.

Each test runs workers/hangs.py under mpiexec (under whichever MPI is installed)
and measures how long the job took to end: a hang would hit the test's timeout.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi_launch import WORKERS, check_ok, child_env, mpiexec, run_mpi

from fsdp_mpi.communication.failures import collective_log
from fsdp_mpi.communication.failures.collective_log import CollectiveLog
from fsdp_mpi.communication.settings import TIMEOUT, read_seconds

# MPI start-up, importing torch and building the model take a few seconds per rank on a loaded 2-core machine.
START_UP_SECONDS = 30


def run_timed(mode: str, nprocs: int, out: Path, limit: float = 60,
              **env: str) -> tuple[subprocess.CompletedProcess, float]:
    """Runs hangs.py in `mode` with `env` added; a job still running after `limit` seconds is a hang."""
    start = time.monotonic()
    result = run_mpi("hangs.py", nprocs, out, mode, timeout=limit, env=env)
    return result, time.monotonic() - start


def test_uneven_steps_end_with_the_watchdog_report_after_the_timeout(tmp_path):
    timeout = 5
    result, elapsed = run_timed("uneven", 2, tmp_path / "out.json", limit=timeout + START_UP_SECONDS,
                                **{TIMEOUT.name: str(timeout)})
    assert result.returncode != 0
    assert "rank 1 left the training loop" in result.stdout
    report = result.stderr
    assert f"rank 0 (on {socket.gethostname()}) has waited {timeout}." in report, report
    # rank 1 has left: it answers no question from rank 0's watchdog, which asks a quarter of the timeout early
    assert f"No answer within {timeout / 4:g} s from {socket.gethostname()} (rank 1: some of its ranks)" in report
    # What it waits in (the next step's first gather: the root unit), and the history before it.
    assert "in collective #50 all_gather of unit '<root>', sending 6,208 float32" in report, report
    assert "#48 reduce_scatter of unit '<root>'" in report and "not finished" in report
    assert "#49 all_reduce of unit '<which parameters got gradients>'" in report
    assert elapsed < timeout + START_UP_SECONDS, f"took {elapsed:.0f} s"


def test_a_rank_stalled_outside_mpi_is_reported_alive(tmp_path):
    timeout = 4
    result, elapsed = run_timed("stalled", 2, tmp_path / "out.json", limit=timeout + START_UP_SECONDS,
                                **{TIMEOUT.name: str(timeout)})
    assert result.returncode != 0
    assert f"Every other rank answered within {timeout / 4:g} s: they are alive and reachable" in result.stderr, \
        result.stderr
    assert elapsed < timeout + START_UP_SECONDS, f"took {elapsed:.0f} s"


def test_an_error_on_a_rank_that_holds_its_model_alone_ends_the_job(tmp_path):
    """A wrapper on a communicator of one rank in a job of several (each rank trains the whole model): rank 0's
    uncaught exception ends the job, not only rank 0, which would leave rank 1 waiting for it forever."""
    try:  # the watchdog off: the abort ends it, or nothing does
        result, elapsed = run_timed("raise_alone", 2, tmp_path / "out.json", limit=START_UP_SECONDS,
                                    **{TIMEOUT.name: "0"})
    except subprocess.TimeoutExpired:
        pytest.fail(f"rank 1 still waited for rank 0 {START_UP_SECONDS} s after the job started")
    assert result.returncode != 0
    assert "rank 0 fails on purpose" in result.stderr
    assert "fsdp_mpi: rank 0 raised RuntimeError; aborting the MPI job" in result.stderr, result.stderr
    assert elapsed < START_UP_SECONDS, f"took {elapsed:.0f} s"


def test_verify_mode_names_the_ranks_and_units_that_diverge(tmp_path):
    result, elapsed = run_timed("unit_order", 3, tmp_path / "out.json")
    assert result.returncode != 0
    assert "CollectiveMismatchError: ranks are entering different collectives" in result.stderr
    assert "ranks 0, 2: #7 all_gather of unit 'blocks.0', sending 24 float32" in result.stderr
    assert "rank 1: #7 all_gather of unit 'blocks.1', sending 24 float32" in result.stderr
    assert elapsed < START_UP_SECONDS, f"took {elapsed:.0f} s"


def test_verify_mode_passes_every_switch_and_changes_no_result(tmp_path):
    out = tmp_path / "out.json"
    check_ok(run_mpi("hangs.py", 2, out, "verified"))
    report = json.loads(out.read_text())
    assert report["verified"] == report["plain"]


def test_even_batches_stops_every_rank_when_the_first_runs_out(tmp_path):
    out = tmp_path / "out.json"
    check_ok(run_timed("even_batches", 3, out, **{TIMEOUT.name: "10"})[0])
    report = json.loads(out.read_text())
    assert report["taken"] == [[0, 1, 2]] * 3  # ranks held 5, 3 and 4 batches
    assert report["warnings"] == ["fsdp_mpi.loop.even_batches: a rank ran out of batches after 3; ranks [0, 2] had more, "
                                  "which were skipped so that no rank waits for the others"]


def test_a_killed_rank_ends_the_job(tmp_path):
    out = tmp_path / "out.json"
    result, elapsed = run_timed("kill", 3, out, **{TIMEOUT.name: "0"})  # the launcher ends it, not the watchdog
    assert result.returncode != 0
    assert elapsed < START_UP_SECONDS, f"took {elapsed:.0f} s"
    # It ended because of the kill: every rank had started, the launcher names rank 1's signal, no rank is left.
    pids = [int(Path(f"{out}.pids.{rank}").read_text()) for rank in range(3)]
    assert re.search(r"signal:? 9\b", result.stdout + result.stderr, re.IGNORECASE), result.stdout + result.stderr
    assert not any(_alive(pid) for pid in pids)


def test_sigterm_to_the_launcher_ends_every_rank(tmp_path):
    out = tmp_path / "out.json"
    env = child_env()
    launcher = subprocess.Popen([mpiexec(), "-n", "2", sys.executable, str(WORKERS / "hangs.py"), str(out), "forever"],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pid_files = [Path(f"{out}.pids.{rank}") for rank in range(2)]
        deadline = time.monotonic() + 120
        while not all(path.exists() and path.read_text() for path in pid_files):
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.communicate(timeout=10)
            time.sleep(0.2)
        pids = [int(path.read_text()) for path in pid_files]
        sent = time.monotonic()
        launcher.send_signal(signal.SIGTERM)
        returncode = launcher.wait(timeout=60)
        while any(_alive(pid) for pid in pids) and time.monotonic() < sent + 30:
            time.sleep(0.1)
        gone = time.monotonic() - sent
    finally:
        launcher.kill()
        launcher.communicate()
    assert returncode != 0
    assert not any(_alive(pid) for pid in pids), f"ranks {pids} still running {gone:.0f} s after SIGTERM"
    assert gone < 15, f"ranks took {gone:.0f} s to end"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie has ended; only its parent has not collected it yet
            return stat.read().split(") ")[-1][0] != "Z"
    except FileNotFoundError:  # collected meanwhile
        return False


@pytest.mark.parametrize("value, seconds", [("", 600.0), ("0", 0.0), ("2.5", 2.5)])
def test_timeout_variable(monkeypatch, value, seconds):
    monkeypatch.setenv(TIMEOUT.name, value)
    assert read_seconds(TIMEOUT) == seconds


@pytest.mark.parametrize("value", ["-1", "ten", "nan"])
def test_a_bad_timeout_is_refused_with_the_variable_named(monkeypatch, value):
    monkeypatch.setenv(TIMEOUT.name, value)
    with pytest.raises(ValueError, match=f"{TIMEOUT.name}='{value}'"):
        read_seconds(TIMEOUT)


@pytest.mark.one_rank  # as above: the log's first collective starts its watchdog
def test_the_log_keeps_only_the_last_records_in_order():
    log = CollectiveLog(capacity=3)
    for sequence in range(5):
        record = log.begin(sequence, "all_gather", "h.0", 10, "float32")
        with log.blocking(record, timeout=0, rank=0):
            pass
    assert [record.sequence for record in log.records] == [2, 3, 4]
    assert log.recent().splitlines()[0].startswith("  #2 all_gather of unit 'h.0', sending 10 float32: took ")
    assert log.blocked == {}


@pytest.mark.one_rank  # its watchdog thread goes on: in pytest's process it would be there at every later fork
def test_the_watchdog_reports_a_collective_that_outlasts_its_timeout(monkeypatch):
    """In this process, with the abort replaced by a note: the report comes at the timeout, not before, and says
    how long the rank has waited (on a loaded machine the watchdog may wake later than the timeout: no upper
    bound on when, or on the time it reports)."""
    reports = []
    monkeypatch.setattr(collective_log, "abort_job", lambda message: reports.append((time.monotonic(), message)))
    log = CollectiveLog()
    started = time.monotonic()
    record = log.begin(7, "reduce_scatter", "h.1", 12, "float32")
    with log.blocking(record, timeout=0.4, rank=3):
        while not reports and time.monotonic() < started + 5:
            time.sleep(0.05)
    assert len(reports) == 1, "no report within 5 s of a 0.4 s timeout"
    at, message = reports[0]
    assert at - started >= 0.4
    waited = re.match(rf"fsdp_mpi watchdog: rank 3 \(on {re.escape(socket.gethostname())}\) has waited (\d+\.\d) s",
                      message)
    assert waited and 0.4 <= float(waited[1]) <= at - started + 0.05, message  # .1f: rounded to 0.05
    assert " s in collective #7 reduce_scatter of unit 'h.1', sending 12 float32; its partners never arrived." in message

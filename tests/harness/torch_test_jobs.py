"""Running torch's test base (workers/torch_test_base.py) to its end whatever a test does: a test that hangs or
ends the job is recorded as such, and a fresh job goes on from the next test, as torch gives each test a fresh
process."""

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mpi_launch import WORKERS, child_env, mpiexec, python_command

RUNNER = WORKERS / "torch_test_base.py"


@dataclass
class Outcomes:
    """Each test's outcome over the ranks (failed if any rank failed) and, for those that did not pass or skip,
    a line of why; how many jobs it took."""

    by_test: dict[str, str] = field(default_factory=dict)
    why: dict[str, str] = field(default_factory=dict)
    gate: dict[str, str] = field(default_factory=dict)  # mpi or gloo: whose test set opened it; closed: neither
    jobs: int = 0

    def counts(self) -> Counter:
        return Counter(self.by_test.values())

    def named(self, *outcomes: str) -> dict[str, str]:
        return {name: self.why.get(name, "") for name, outcome in self.by_test.items() if outcome in outcomes}


def run_test_base(backend: str, nprocs: int, work: Path, tests: list[str] = (), stall_s: float = 60,
                  env: dict[str, str] | None = None) -> Outcomes:
    """Runs the test base for `backend` on `nprocs` ranks in `work` (all tests, or `tests`). A job that makes no
    progress for `stall_s` seconds is killed and its test recorded as hung; a job that ends early had its test
    end it (crashed); either way the next job starts at the test after it."""
    temp = work / "temp"
    temp.mkdir(parents=True, exist_ok=True)
    out = work / "out"
    first, outcomes = None, Outcomes()
    while True:
        command = [mpiexec(), "-n", str(nprocs), *python_command(RUNNER), backend, str(temp), str(out),
                   *(["--from", first] if first else []), *tests]
        outcomes.jobs += 1
        log = work / f"job-{outcomes.jobs}.log"  # a file, not a pipe: a job never waits for its reader
        with open(log, "w") as said:
            job = subprocess.Popen(command, env=child_env(**(env or {})), stdout=said, stderr=subprocess.STDOUT,
                                   start_new_session=True)
            finished = _watch(job, out, nprocs, stall_s)
        plan_file = out.with_suffix(".plan")
        plan = json.loads(plan_file.read_text()) if plan_file.exists() else []
        if finished or _all_ended(out, nprocs, plan):
            if _in_flight(out, nprocs) is None:
                break
        # The test some rank is in; else the last one ended, which left the ranks out of step between tests.
        last = _in_flight(out, nprocs) or _last_ended(out, nprocs, plan)
        if last is None:  # ended before its first test: nothing more will run
            raise RuntimeError(f"the test base's job ended before a test began:\n{log.read_text()[-3000:]}")
        _record(out, last, "hung" if not finished else "crashed", log)
        if plan.index(last) + 1 == len(plan):
            break
        first = plan[plan.index(last) + 1]
    return _outcomes(out, nprocs, outcomes)


def _watch(job: subprocess.Popen, out: Path, nprocs: int, stall_s: float) -> bool:
    """Waits for `job`; True if it ended by itself, False if it was killed after `stall_s` without progress."""
    progress, since = -1, time.monotonic()
    while job.poll() is None:
        now = _lines(out, nprocs)
        if now != progress:
            progress, since = now, time.monotonic()
        elif time.monotonic() - since > stall_s:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()
            return False
        time.sleep(0.5)
    return True


def _lines(out: Path, nprocs: int) -> int:
    return sum(len(path.read_text().splitlines()) for rank in range(nprocs)
               if (path := Path(f"{out}.{rank}")).exists())


def _entries(out: Path, rank: int) -> list[dict]:
    path = Path(f"{out}.{rank}")
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _in_flight(out: Path, nprocs: int) -> str | None:
    """The test some rank started and did not end, if any (the first such in the plan's order)."""
    for rank in range(nprocs):
        entries = _entries(out, rank)
        if entries and entries[-1]["outcome"] == "started":
            return entries[-1]["test"]
    return None


def _last_ended(out: Path, nprocs: int, plan: list[str]) -> str | None:
    """The test latest in the plan that some rank ended."""
    ended = {entry["test"] for rank in range(nprocs) for entry in _entries(out, rank) if entry["outcome"] != "started"}
    return max(ended & set(plan), key=plan.index, default=None)


def _all_ended(out: Path, nprocs: int, plan: list[str]) -> bool:
    """Whether every rank ended every test of the plan (a job killed after that hung at its own end)."""
    return bool(plan) and all({entry["test"] for entry in _entries(out, rank) if entry["outcome"] != "started"}
                              >= set(plan) for rank in range(nprocs))


def _record(out: Path, test: str, outcome: str, log: Path) -> None:
    lines = [line for line in log.read_text(errors="replace").splitlines() if "USDT:" not in line]
    with open(f"{out}.0", "a") as record:
        record.write(json.dumps({"test": test, "outcome": outcome, "detail": "\n".join(lines[-30:])}) + "\n")


def _outcomes(out: Path, nprocs: int, outcomes: Outcomes) -> Outcomes:
    """A test's outcome on a rank is its last (a test that hung or crashed: only its start); over the ranks, the
    worst: hung, crashed, error, failed, started, skipped, passed, in that order."""
    worst = ("hung", "crashed", "error", "failed", "started", "skipped", "passed")
    finals: dict[str, list[dict]] = {}
    for rank in range(nprocs):
        last: dict[str, dict] = {}
        for entry in _entries(out, rank):
            if entry["outcome"] != "started" or entry["test"] not in last:
                last[entry["test"]] = entry
        for name, entry in last.items():
            finals.setdefault(name, []).append(entry)
    for name, entries in finals.items():
        entry = min(entries, key=lambda e: worst.index(e["outcome"]))
        outcomes.by_test[name] = entry["outcome"]
        outcomes.gate[name] = next((e["gate"] for e in entries if e.get("gate")), "")
        lines = [line for line in entry.get("detail", "").strip().splitlines() if line.strip()]
        errors = [line for line in lines if "Error" in line or "error" in line]
        outcomes.why[name] = (errors or lines or [""])[-1][:300]
    return outcomes


def main() -> None:
    """python tests/harness/torch_test_jobs.py BACKEND RANKS WORK [TEST ...]: the counts, and each test that did
    not pass or skip, with why (hpc/gpu_check.sh's torch-test-base step)."""
    backend, ranks, work, *tests = sys.argv[1:]
    outcomes = run_test_base(backend, int(ranks), Path(work), tests)
    print(json.dumps(dict(outcomes.counts())), f"in {outcomes.jobs} job(s)")
    for name, why in sorted(outcomes.named("hung", "crashed", "error", "failed").items()):
        print(f"{outcomes.by_test[name]:8} {name}: {why}")
    (Path(work) / "outcomes.json").write_text(json.dumps({"by_test": outcomes.by_test, "why": outcomes.why,
                                                          "gate": outcomes.gate}, indent=1))


if __name__ == "__main__":
    main()

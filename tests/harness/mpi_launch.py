"""Launching test workers under mpiexec from pytest, with a timeout so that a hang fails."""

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import warm_ranks

WORKERS = Path(__file__).parents[1] / "workers"
REPO_ROOT = Path(__file__).parents[2]


def mpiexec() -> str:
    """``$FSDP_MPI_MPIEXEC`` if set (hpc/gpu_check.sh sets it), else the mpiexec beside this Python (the mpich
    wheel's), else the first on PATH."""
    named = os.environ.get("FSDP_MPI_MPIEXEC", "").strip()
    if named and Path(named).is_file():  # a launcher alone; one with options is for the benchmarks (launch.py)
        return named
    beside_python = Path(sys.executable).parent / "mpiexec"
    found = str(beside_python) if beside_python.exists() else shutil.which("mpiexec")
    if found is None:
        raise RuntimeError("no mpiexec found: pip install mpich, or load your site's MPI module")
    return found


def child_env(**variables: str) -> dict[str, str]:
    """This process's environment for a launched program: one thread per rank, the checkout first on PYTHONPATH
    and what PYTHONPATH had after it (a cluster's module system, an install under a prefix, as hpc/gpu_check.sh
    makes, put packages there), then `variables`."""
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **variables}


_warm_ranks: list[warm_ranks.WarmRanks | None] = []


def only_these_slots(env: dict[str, str], slots: int) -> list[str]:
    """Open MPI's mpiexec arguments that give the job `slots` slots on this machine and no more (a grow-back's
    spawn beyond them is refused), `env` rid of CI's oversubscribing policy, which would let it through."""
    env.pop("PRTE_MCA_rmaps_default_mapping_policy", None)
    return ["--host", f"localhost:{slots}", "--bind-to", "none"]


def python_command(*program: str | Path) -> list[str]:
    """How a launched rank runs `program` (a script, or "-m" and a module): through harness/warm_ranks.py, which
    forks it warm from a server that has imported torch where the launcher allows, on the servers of this
    session (started at the first launch, and inherited by the pytest runs it starts: the mutants').
    FSDP_MPI_WARM_RANKS=0: every rank cold."""
    if os.environ.get(warm_ranks.SOCKETS_ENV) is None:
        launcher = warm_launcher()
        servers = warm_ranks.WarmRanks(_as_a_rank_starts(child_env(), launcher)) if launcher else None
        _warm_ranks.append(servers)  # kept for the session: they end when it does (their stdin closes)
        os.environ[warm_ranks.SOCKETS_ENV] = os.pathsep.join(servers.sockets) if servers and servers.ready else "0"
    if os.environ[warm_ranks.SOCKETS_ENV] == "0":
        return [sys.executable, *map(str, program)]
    return [sys.executable, warm_ranks.CLIENT, *map(str, program)]


def warm_launcher() -> str | None:
    """This session's launcher where warm ranks are tested under its protocol: "hydra" (MPICH's, or Intel MPI's,
    which speaks the same to its ranks) or "open_mpi" (PRRTE); None for any other (its ranks start cold)."""
    version = subprocess.run([mpiexec(), "--version"], capture_output=True, text=True, timeout=60).stdout
    if version.startswith("HYDRA build details") or version.startswith("Intel(R) MPI Library"):
        return "hydra"
    return "open_mpi" if "Open MPI" in version else None


def _as_a_rank_starts(env: dict[str, str], launcher: str) -> dict[str, str]:
    """`env` as a launched rank gets it, where that matters to how it starts (warm_ranks.READ_AT_LOAD): Open MPI's
    launcher puts its library folder first on a rank's LD_LIBRARY_PATH, which the servers must share for its ranks
    to start warm (asked of the launcher itself, once a session)."""
    if launcher != "open_mpi":
        return env
    asked = subprocess.run([mpiexec(), "-n", "1", "printenv", "LD_LIBRARY_PATH"], capture_output=True, text=True,
                           timeout=60, env=env)
    ranks_path = asked.stdout.strip() if asked.returncode == 0 else env.get("LD_LIBRARY_PATH", "")
    return {**env, "LD_LIBRARY_PATH": ranks_path} if ranks_path else env


def experiments_launcher() -> str:
    """``$FSDP_MPI_MPIEXEC`` for the experiments that launch ranks themselves (bench.py, predict.py): this
    session's mpiexec, through harness/warm_mpiexec.py, which starts the ranks as `python_command` does."""
    python_command()  # the servers started, and named in this process's environment (which the launch inherits)
    return shlex.join([sys.executable, str(Path(__file__).parent / "warm_mpiexec.py"), mpiexec()])


def run_mpi(worker: str | Path, nprocs: int, *args: str, timeout: float = 240,
            env: dict[str, str] | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Runs tests/workers/<worker> (or the script at the absolute path `worker`) on `nprocs` ranks in `cwd`
    (with `env` added to the environment); returns the finished process (never raises on failure)."""
    command = [mpiexec(), "-n", str(nprocs), *python_command(WORKERS / worker), *map(str, args)]
    env = child_env(**(env or {}))  # after python_command, which names this session's servers in the environment
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)


class RunFailed(Exception):
    """A launched run ended in error without any failed check: a crash, not a wrong answer."""


# A Python traceback's last line when an `assert` (or torch.testing.assert_close) failed in a rank; or, where
# two ranks' tracebacks interleave on one stream ("AssertionErrorAssertionError: : ..."), the line fsdp_mpi's
# abort path writes, wherever it lands, for each rank whose check failed.
_FAILED_CHECK = re.compile(r"^(\w+\.)*AssertionError\b|fsdp_mpi: rank \d+ raised AssertionError; aborting",
                           re.MULTILINE)


def check_ok(result: subprocess.CompletedProcess) -> None:
    """Passes if the run succeeded. If it did not, fails as an AssertionError when a check inside it failed
    (the test's verdict), or raises RunFailed when it crashed: the mutants count only the first as a kill."""
    if result.returncode == 0:
        return
    output = f"exit {result.returncode}\nstdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    if _FAILED_CHECK.search(result.stderr) or _FAILED_CHECK.search(result.stdout):
        raise AssertionError(f"a check failed in the run: {output}")
    raise RunFailed(output)

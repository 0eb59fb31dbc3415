"""The test harness's own rules (conftest.py), which every other test relies on."""

import importlib.util
import json
import mmap
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi_launch import child_env, experiments_launcher, run_mpi, warm_launcher
from warm_ranks import CLIENT as WARM_CLIENT
from warm_ranks import Load

STARTS_CUDA = '''
import torch

def test_starts_cuda():
    torch.cuda.is_initialized = lambda: True  # as pinning memory on a machine with a GPU leaves it

def test_after_it():
    pass
'''


PASSES_THEN_FAILS = '''
import os

def test_passes(outcomes_so_far):
    assert "test_mine.py::test_passed_in_an_earlier_run" in outcomes_so_far

def test_passed_in_an_earlier_run():
    pass

def test_fails():
    assert os.environ.get("SECOND_RUN") == "fixed"
'''


def run_pytest_with_conftest(folder: Path, *args: str, **variables: str) -> subprocess.CompletedProcess:
    """pytest in `folder` with this suite's conftest.py as a plugin, so that its rules apply to tests written there."""
    env = child_env(**variables)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env["PYTHONPATH"]])
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "conftest", "-p", "no:cacheprovider", "-rA", *args],
                          cwd=folder, env=env, capture_output=True, text=True, timeout=120)


def test_a_test_that_starts_cuda_in_pytests_process_is_named(tmp_path):
    """On a GPU machine the next one_rank test's child could not use CUDA: the test that started it fails instead,
    and only that one (CUDA stays started for the rest, which did nothing)."""
    (tmp_path / "test_cuda.py").write_text(STARTS_CUDA)
    result = run_pytest_with_conftest(tmp_path, "test_cuda.py")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ERROR at teardown of test_starts_cuda" in result.stdout, result.stdout
    assert "Failed: this test initialised CUDA in pytest's own process" in result.stdout
    assert "2 passed, 1 error" in result.stdout  # the one that started it, not the one after


def test_a_run_cut_short_goes_on_with_the_tests_that_had_not_passed(tmp_path):
    """FSDP_MPI_TESTS_PASSED: a run adds each test that passes to the file, and a later run on the same code
    leaves out those already there, and counts them as passed (for the mutants that name them)."""
    (tmp_path / "test_mine.py").write_text(PASSES_THEN_FAILS)
    passed = tmp_path / "passed.txt"
    passed.write_text("test_mine.py::test_passed_in_an_earlier_run\n")  # as a cut run of the same code left it
    first = run_pytest_with_conftest(tmp_path, "test_mine.py", FSDP_MPI_TESTS_PASSED=str(passed))
    assert "1 failed, 1 passed, 1 deselected" in first.stdout, first.stdout + first.stderr
    earlier, passes = "test_mine.py::test_passed_in_an_earlier_run", "test_mine.py::test_passes"
    assert passed.read_text().splitlines() == [earlier, passes]
    second = run_pytest_with_conftest(tmp_path, "test_mine.py", FSDP_MPI_TESTS_PASSED=str(passed), SECOND_RUN="fixed")
    assert "1 passed, 2 deselected" in second.stdout, second.stdout + second.stderr
    assert passed.read_text().splitlines()[2:] == ["test_mine.py::test_fails"]


LEAVES_MPI_SEGMENTS = '''
import os
from pathlib import Path

def test_a_killed_rank_leaves_its_segments():
    for name in os.environ["MADE_IN_SESSION"].split():
        Path(name).touch()  # made (or changed) while the session runs, as a killed rank's MPI library does
'''


def test_a_session_removes_the_mpi_segments_it_left_that_nothing_maps(tmp_path):
    """At its end the suite removes from /dev/shm the segments MPI libraries leave when a rank is killed (MPICH's
    ``mpich_shm_*``, Open MPI's ``sm_segment.*``) that were made during the session and that no process maps:
    not one a live process maps, not one older than the session, not a file of another name."""
    tag = f"fsdp_mpi_harness_{os.getpid()}"
    shm = Path("/dev/shm")
    left, mapped, older, other = (shm / f"mpich_shm_{tag}", shm / f"sm_segment.{tag}", shm / f"mpich_shm_{tag}_old",
                                  shm / f"{tag}_not_mpis")
    for path in (mapped, older, other):
        path.write_bytes(bytes(4096))
    os.utime(older, (time.time() - 3600,) * 2)
    try:
        with open(mapped, "r+b") as file, mmap.mmap(file.fileno(), 4096):  # a live job's segment: this process's
            (tmp_path / "test_segments.py").write_text(LEAVES_MPI_SEGMENTS)
            result = run_pytest_with_conftest(tmp_path, "test_segments.py",
                                              MADE_IN_SESSION=" ".join(map(str, (left, mapped, other))))
            assert "1 passed" in result.stdout, result.stdout + result.stderr
            assert not left.exists()
            assert mapped.exists() and older.exists() and other.exists()
    finally:
        for path in (left, mapped, older, other):
            path.unlink(missing_ok=True)


RANK_REPORT = '''
import json, os, sys
from pathlib import Path

warm = "torch" in sys.modules  # a cold rank has imported nothing yet
compiler = "torch._dynamo" in sys.modules
lightning = "lightning.pytorch" in sys.modules
from mpi4py import MPI

rank = MPI.COMM_WORLD.Get_rank()
report = {"warm": warm, "compiler": compiler, "lightning": lightning, "hash": hash("fsdp_mpi"), "folder": os.getcwd(),
          "argv": sys.argv[1:], "interpreter_argv": sys.orig_argv, "program": sys.argv[0], "first_on_path": sys.path[0]}
Path(sys.argv[1], f"{rank}.json").write_text(json.dumps(report))
MPI.COMM_WORLD.Barrier()
sys.exit(int(sys.argv[2]) if rank == 1 else 0)
'''


LIGHTNING_INSTALLED = importlib.util.find_spec("lightning") is not None

# A module that reads its settings as tqdm does (a walk through every variable's name and value, for those of a
# prefix), lists the variables' names, and reads one setting by name.
READS_AT_LOAD = '''
import os

WALKED = {name: value for name, value in os.environ.items() if name.startswith("TQDM_")}
LISTED = [name for name in os.environ if name.startswith("FSSPEC_")]
SETTING = os.environ.get("WARM_RANKS_SETTING")
'''
NOTES_FSSPEC = "import json; from warm_ranks import Load; print(json.dumps(sorted(Load(['fsspec']).looked_up)))"


def test_a_server_notes_the_variables_read_by_name_as_it_loads_not_those_a_walk_passes(tmp_path, monkeypatch):
    """What makes a rank start cold (harness/warm_ranks.py: Load): a variable a module read by name as the server
    loaded it, set otherwise for the rank; not one that a walk through every variable only passed (a rank's own
    folder, its shell's variables), which would start every rank cold; fsspec's walk (imported by Lightning, the
    servers' third module) included."""
    (tmp_path / "reads_at_load.py").write_text(READS_AT_LOAD)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("WARM_RANKS_SETTING", "1")
    loaded = Load(["reads_at_load"])
    assert loaded.looked_up == {"WARM_RANKS_SETTING"}
    assert loaded.read_alike({**os.environ, "PWD": str(tmp_path), "OLDPWD": "/"})
    assert not loaded.read_alike({**os.environ, "WARM_RANKS_SETTING": "2"})
    assert not loaded.read_alike({**os.environ, "TQDM_MININTERVAL": "5"})  # READ_AT_LOAD's prefix
    if importlib.util.find_spec("fsspec") is None:
        return
    noted = subprocess.run([sys.executable, "-c", NOTES_FSSPEC], capture_output=True, text=True, check=True,
                           cwd=Path(__file__).parent / "harness", env={**os.environ, "PWD": str(tmp_path)})
    assert "PWD" not in json.loads(noted.stdout) and "FSSPEC_CONFIG_DIR" in json.loads(noted.stdout)


def test_launched_ranks_start_warm_hash_apart_and_end_as_their_script_does(tmp_path):
    """Under MPICH, Open MPI and Intel MPI, a launched rank is forked from a server that imported torch, its
    compiler and Lightning (where installed): all are loaded before its first line, it runs in the launch's folder
    with the script's folder first on sys.path and its arguments (sys.orig_argv too), two ranks hash strings apart
    (as cold ranks do), and the job ends with the exit status the script gave; a rank whose GLIBC_TUNABLES (read by the C library) or
    TORCHINDUCTOR_CACHE_DIR (looked up by torch's compiler as it loads) differ from the servers' starts cold."""
    if warm_launcher() is None:
        pytest.skip("this launcher's ranks start cold (harness/mpi_launch.py: warm_launcher)")
    script = tmp_path / "scripts" / "report.py"
    script.parent.mkdir()
    script.write_text(RANK_REPORT)
    for differing, exit_status in (({}, 3), ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, 0),
                                   ({"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}, 5)):
        out = tmp_path / f"out{exit_status}"
        out.mkdir()
        result = run_mpi(script, 2, out, exit_status, env=differing, cwd=tmp_path)
        assert result.returncode == exit_status, result.stderr[-2000:]
        reports = [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]
        assert [(report["warm"], report["compiler"], report["lightning"]) for report in reports] == [
            (not differing, not differing, LIGHTNING_INSTALLED and not differing)] * 2
        assert {report["folder"] for report in reports} == {str(tmp_path)}
        assert {report["first_on_path"] for report in reports} == {str(script.parent)}
        assert reports[0]["argv"] == [str(out), str(exit_status)]
        # What a grow-back's spawn runs again (failures/job.py): the command line the rank's process was started
        # with, the client's where it runs warm, so that its newcomers start as the run's ranks did.
        client = [WARM_CLIENT] if not differing else []
        assert reports[0]["interpreter_argv"] == [sys.executable, *client, str(script), str(out), str(exit_status)]
        assert reports[0]["hash"] != reports[1]["hash"]


@pytest.mark.one_mpi  # bench.py's and predict.py's launcher: they are tested under the first MPI
def test_the_experiments_launches_start_warm_as_python_m_would(tmp_path):
    """The launcher the tests give bench.py and predict.py (``$FSDP_MPI_MPIEXEC``: mpiexec through
    harness/warm_mpiexec.py) starts their ``python -m`` ranks warm, as ``python -m`` would: the module's file as
    sys.argv[0], the current folder first on sys.path, the arguments after."""
    folder = tmp_path
    (folder / "report_module.py").write_text(RANK_REPORT)
    out = folder / "out"
    out.mkdir()
    command = [*shlex.split(experiments_launcher()), "-n", "2", sys.executable, "-m", "report_module", out, "4"]
    result = subprocess.run(command, cwd=folder, env=child_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 4, result.stderr[-2000:]
    reports = [json.loads((out / f"{rank}.json").read_text()) for rank in range(2)]
    assert [report["warm"] for report in reports] == [True, True]
    assert {report["program"] for report in reports} == {str(folder / "report_module.py")}
    assert {report["first_on_path"] for report in reports} == {str(folder)}
    assert reports[1]["argv"] == [str(out), "4"]

"""hpc/gpu_check.sh read before a GPU is lent: every command its steps would run launches a script that exists,
with arguments that script's own parser accepts, fits one call of a lent machine, and selects GPU tests that
exist. A loan lasts minutes; a step that dies on a renamed option or test is a loan's step lost. The script's
dry form (FSDP_MPI_GPU_CHECK_DRY=1) prints the commands instead of running them, so no GPU is needed here."""

import os
import re
import shlex
import subprocess
import sys

import pytest
from mpi_launch import REPO_ROOT
from training.options import UsageError

pytestmark = pytest.mark.one_mpi  # the GPU check's command lines, not the MPI library

GPU_CHECK = REPO_ROOT / "hpc" / "gpu_check.sh"
CALL_LIMIT_S = 600  # the longest command a lent machine runs (the device tool's per-call limit)


def named_only_steps() -> list[str]:
    """The steps the script runs only when named (its `[[ "$only" == *" NAME "* ]]` tests), and the groups of
    steps named at once (`expand GROUP STEP...`)."""
    script = GPU_CHECK.read_text()
    return sorted(set(re.findall(r'\*" ([a-z0-9-]+) "\*', script) + re.findall(r"^expand ([a-z0-9-]+)", script, re.M)))


def dry_run(*steps: str, quick: bool) -> list[tuple[str, int, list[str]]]:
    """(name, time limit s, command words) of each command the check would run, in order."""
    env = {**os.environ, "FSDP_MPI_GPU_CHECK_DRY": "1", "FSDP_MPI_GPU_CHECK_QUICK": "1" if quick else "0"}
    done = subprocess.run(["bash", str(GPU_CHECK), *steps], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    commands = []
    for line in done.stdout.splitlines():
        if line.startswith("logs, CSVs and summary in"):
            continue
        name, seconds, *words = shlex.split(line)
        commands.append((name, int(seconds), words))
    return commands


def launched(words: list[str]) -> list[str]:
    """What a rank runs: the command without `env NAME=VALUE ...` and `mpiexec -n K` before it."""
    if words[0] == "env":
        words = words[1:]
        while "=" in words[0]:
            words = words[1:]
    if os.path.basename(words[0]) == "mpiexec":
        assert words[1] == "-n" and words[2].isdigit(), words
        words = words[3:]
    assert words[0] == "python", words
    return words[1:]


def check_experiment(script: str, argv: list[str], monkeypatch) -> None:
    """Raises SystemExit (argparse's usage error) or UsageError where `script` would refuse `argv`."""
    if script == "experiments/bench.py":
        import bench
        bench.arguments(argv)
    elif script in ("experiments/run_gpt2.py", "experiments/run_bert.py"):
        import run_bert
        import run_gpt2
        from training.options import check_checkpoint_options, check_config  # the checks of training/run.py
        module, config_type = ((run_gpt2, run_gpt2.GPT2RunConfig) if script.endswith("gpt2.py")
                               else (run_bert, run_bert.RunConfig))
        parser = module.parser()
        options = parser.parse_args(argv)
        check_checkpoint_options(parser, options)
        check_config(config_type.from_namespace(options))
    elif script == "experiments/bench_comm.py":
        import bench_comm
        monkeypatch.setattr(sys, "argv", [script, *argv])
        bench_comm.arguments()


def check_test_selection(argv: list[str]) -> None:
    """Every test file a pytest command names exists, and every word of its -k names a test in them."""
    files = [REPO_ROOT / word for word in argv if word.startswith("tests/")]
    assert all(path.is_file() for path in files), files
    if "-k" in argv:
        tests = " ".join(re.findall(r"^def (test_\w+)", "".join(path.read_text() for path in files), re.MULTILINE))
        words = set(re.findall(r"\w+", argv[argv.index("-k") + 1])) - {"and", "or", "not"}
        assert words and all(word in tests for word in words), (words, files)


def test_the_dry_form_prints_every_named_step_and_runs_nothing():
    named = named_only_steps()
    assert {"seed-report", "pytest-all", "offload", "torch-test-base", "impi-direct", "compiled-whole",
            "torch-distributed", "two-level"} <= set(named)  # steps, and groups of steps
    before = set((REPO_ROOT / "results").glob("gpu-check-*"))
    names = [name for name, _, _ in dry_run(*named, quick=True)]
    assert set((REPO_ROOT / "results").glob("gpu-check-*")) == before  # no folder of logs made
    # each named step, or the commands it names (seed-report's runs, compiled-whole's four), is there once
    assert len(names) == len(set(names))
    assert {"pytest-all", "torch-test-base", "offload", "bench-mfu-blocks", "impi-gpu-lane"} <= set(names)
    assert sum(name.startswith("seed-run_") for name in names) == 2 * 9 * 3  # 2 scripts, 9 strategies, 3 rounds
    # a group's step named alone runs alone
    assert [name for name, _, _ in dry_run("compiled-whole-gpt2", "torch-distributed-gpt2", quick=True)] == [
        "torch-distributed-gpt2", "compiled-whole-gpt2"]


def test_an_earlier_calls_passed_tests_that_are_not_there_stop_the_check_before_anything_runs(tmp_path):
    """A second call of pytest-all given a missing file would run the whole suite again, silently, in a lent
    call too short for it: the check refuses, naming the variable."""
    env = {**os.environ, "FSDP_MPI_GPU_CHECK_DRY": "1", "FSDP_MPI_PYTEST_ALL_PASSED": str(tmp_path / "missing.txt")}
    done = subprocess.run(["bash", str(GPU_CHECK), "pytest-all"], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert "FSDP_MPI_PYTEST_ALL_PASSED names no file" in done.stderr


@pytest.mark.parametrize("quick", [True, False], ids=["quick-and-every-named-step", "full-form"])
def test_every_command_of_the_check_would_start(quick, monkeypatch):
    commands = dry_run(*(named_only_steps() if quick else ()), quick=quick)
    assert len(commands) > (60 if quick else 30)
    for name, seconds, words in commands:
        assert 0 < seconds <= CALL_LIMIT_S, name
        argv = launched(words)
        if argv[:2] == ["-m", "pytest"]:
            check_test_selection(argv[2:])
            continue
        if argv[0] == "-c":
            compile(argv[1], name, "exec")
            continue
        script, argv = argv[0], argv[1:]
        assert (REPO_ROOT / script).is_file(), (name, script)
        try:
            check_experiment(script, argv, monkeypatch)
        except (SystemExit, UsageError) as refused:
            pytest.fail(f"{name}: {script} refuses its arguments ({refused!r}): {shlex.join(argv)}")


GPU_CARRY = REPO_ROOT / "hpc" / "gpu_carry.sh"


def test_the_loan_plan_builds_its_carry_from_the_index_and_plans_calls_the_check_runs_within_a_calls_limit():
    """hpc/gpu_carry.sh's dry form: the wheels the GPU image lacks downloaded for its Python, the corpora copied,
    Intel MPI trimmed, into the folder the calls carry and the check reads; each planned call names steps the
    check runs, and the sum of their limits leaves a minute of a call's 600 s."""
    env = {**os.environ, "FSDP_MPI_GPU_CARRY_DRY": "1"}
    done = subprocess.run(["bash", str(GPU_CARRY)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    built = [shlex.split(line[2:]) for line in done.stdout.splitlines() if line.startswith("+ ")]
    download = next(words for words in built if words[:4] == ["python3", "-m", "pip", "download"])
    assert {"--no-deps", "--only-binary=:all:", "mpich", "mpi4py", "expecttest", "accelerate"} <= set(download)
    assert download[download.index("--python-version") + 1] == "3.12"
    wheels = download[download.index("--dest") + 1]
    copied = next(words for words in built if words[:2] == ["cp", "-r"])
    trimmed = next(words for words in built if words[:2] == ["bash", "hpc/trim_impi.sh"])
    calls = [line.split() for line in done.stdout.splitlines() if line.startswith("call ")]
    assert [call[call.index("hpc/gpu_check.sh") + 1] for call in calls][:2] == ["pytest-all", "offload"]
    for call in calls:
        settings = dict(word.split("=", 1) for word in call[2:call.index("bash")])
        assert settings["FSDP_MPI_WHEELS"] == wheels and settings["FSDP_MPI_DATA_DIR"] == copied[-1]
        assert settings["FSDP_MPI_IMPI"] == trimmed[-1]
        steps = call[call.index("hpc/gpu_check.sh") + 1:]
        ran = [name for name, _, _ in dry_run(*steps, quick=True)]
        assert all(any(name.startswith(step) for name in ran) for step in steps), (steps, ran)
        assert int(call[1]) == sum(seconds for _, seconds, _ in dry_run(*steps, quick=True))
        assert int(call[1]) + 60 <= CALL_LIMIT_S, call


def test_the_loan_plan_without_corpora_stops_naming_the_variable(tmp_path):
    env = {**os.environ, "FSDP_MPI_GPU_CARRY_DRY": "1", "FSDP_MPI_DATA_DIR": str(tmp_path / "nothing")}
    done = subprocess.run(["bash", str(GPU_CARRY)], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 2 and done.stdout == ""
    assert "FSDP_MPI_DATA_DIR" in done.stderr

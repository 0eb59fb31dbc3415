"""Lightning's own tests with FSDPMPIStrategy in place of its one-device strategy, against the same tests as
Lightning ships them: what fails only with fsdp_mpi must be in by_design.txt, with its reason, or it is a defect.

    python tests/host_suites/lightning/run_lightning_tests.py LIGHTNING_CHECKOUT [pytest paths...]

LIGHTNING_CHECKOUT: a clone of github.com/Lightning-AI/pytorch-lightning at the tag of the Lightning installed
in this Python (its tests are not in its packages, so CI, which reaches only package registries, cannot run
this). Its test requirements (requirements/pytorch/test.txt) must be installed beside fsdp_mpi. The paths
default to the directories whose tests train through the default strategy. Each runs twice, in one process
each: as Lightning ships it and with ``-p fsdp_mpi_in_place_of_auto``. Prints the tests that fail only with
fsdp_mpi, each with its reason from by_design.txt, and exits 1 if any has none or an entry no longer fails.
"""

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ElementTree
from pathlib import Path

HERE = Path(__file__).parent
BY_DESIGN = HERE / "by_design.txt"
DEFAULT_PATHS = ["models", "loops", "checkpointing", "trainer", "callbacks", "core"]
# Need what Lightning's CI downloads or builds (legacy checkpoints, ONNX Runtime), with or without fsdp_mpi.
IGNORED = ["checkpointing/test_legacy_checkpoints.py", "models/test_onnx.py"]


def failures(checkout: Path, paths: list[str], with_fsdp_mpi: bool) -> tuple[set[str], int]:
    """(ids of the tests that failed or errored, tests run) in one pytest run of Lightning's tests."""
    with tempfile.TemporaryDirectory() as scratch:
        report = Path(scratch) / "junit.xml"
        tests = checkout / "tests" / "tests_pytorch"
        command = [sys.executable, "-m", "pytest", *(str(tests / path) for path in paths),
                   *(f"--ignore={tests / path}" for path in IGNORED), "-q", "-p", "no:cacheprovider",
                   "--color=no", f"--junitxml={report}", "--timeout=300"]
        if with_fsdp_mpi:
            command[3:3] = ["-p", "fsdp_mpi_in_place_of_auto"]
        environment = {**os.environ, "OMP_NUM_THREADS": "1",
                       "PYTHONPATH": os.pathsep.join([str(HERE), str(checkout / "tests")])}
        subprocess.run(command, cwd=checkout / "tests", env=environment, stdout=subprocess.DEVNULL)
        cases = ElementTree.parse(report).getroot().iter("testcase")
        failed, run = set(), 0
        for case in cases:
            run += 1
            if case.find("failure") is not None or case.find("error") is not None:
                failed.add(f"{case.get('classname').removeprefix('tests.')}::{case.get('name')}")  # from tests_pytorch
        return failed, run


def by_design() -> dict[str, str]:
    """by_design.txt: ``test id  # reason`` lines (a reason may cover the lines above it that have none)."""
    reasons, pending = {}, []
    for line in BY_DESIGN.read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        test, _, reason = line.partition("  # ")
        pending.append(test.strip())
        if reason:
            reasons.update(dict.fromkeys(pending, reason.strip()))
            pending = []
    return reasons


def main(checkout: str, *paths: str) -> int:
    checkout = Path(checkout)
    paths = list(paths) or DEFAULT_PATHS
    as_shipped, run = failures(checkout, paths, with_fsdp_mpi=False)
    with_fsdp_mpi, run_with = failures(checkout, paths, with_fsdp_mpi=True)
    ours = sorted(with_fsdp_mpi - as_shipped)
    reasons = by_design()
    reason = {test: reasons.get(test) or reasons.get(test.split("[")[0]) for test in ours}
    unexplained = [test for test in ours if reason[test] is None]
    matched = {test.split("[")[0] for test in ours} | set(ours)
    stale = sorted(test for test in reasons if test not in matched
                   and any(test.startswith(f"tests_pytorch.{path.replace('/', '.')}") for path in paths))
    print(f"{run} tests as Lightning ships them: {len(as_shipped)} failed (this machine's, not fsdp_mpi's)")
    print(f"{run_with} with FSDPMPIStrategy in place of the one-device strategy: {len(with_fsdp_mpi)} failed, "
          f"{len(ours)} of them only with fsdp_mpi, {len(with_fsdp_mpi & as_shipped)} as shipped too")
    for test in ours:
        print(f"  {test}: {reason[test] or 'NOT EXPLAINED'}")
    for test in stale:
        print(f"  {test}: in by_design.txt, but passes: take it out")
    return 1 if unexplained or stale else 0


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    sys.exit(main(*sys.argv[1:]))

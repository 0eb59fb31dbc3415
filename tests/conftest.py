import os
import sys
from pathlib import Path

import pytest

# Tests import the mpiexec launcher, and the experiments' modules as the scripts do (top level).
sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent / "experiments"))

# Where every test must run (CI: data, MPI and transformers are installed), a skip is a failure,
# except for tests that need hardware this machine lacks.
MAY_SKIP_ANYWHERE = ("needs a CUDA device",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped and os.environ.get("FSDP_MPI_STRICT_SKIPS") == "1":
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        if not any(allowed in reason for allowed in MAY_SKIP_ANYWHERE):
            report.outcome = "failed"
            report.longrepr = f"skipped where every test must run (FSDP_MPI_STRICT_SKIPS=1): {reason}"

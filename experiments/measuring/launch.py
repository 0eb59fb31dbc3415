"""Starting a measurement on several ranks: the mpiexec beside this Python, and the bench worker as a module.

``bench.py`` and ``predict.py`` run ``measuring.bench_worker`` under mpiexec with ``python -m`` and the
experiments' folder on ``PYTHONPATH``, where its imports (``training.strategies``, ...) are found, as they are
for a script started as ``python experiments/X.py``.
"""

import os
import shlex
import sys
from pathlib import Path

EXPERIMENTS = Path(__file__).resolve().parent.parent


MPIEXEC_ENV = "FSDP_MPI_MPIEXEC"


def mpiexec(ranks: int) -> list[str]:
    """The launch line for `ranks` ranks: ``$FSDP_MPI_MPIEXEC`` if set (a launcher with its options, e.g. one
    that places ranks on several nodes, docs/clusters.md), else the environment's own mpiexec (the pip
    MPI's) if it has one, else the first on PATH."""
    if os.environ.get(MPIEXEC_ENV, "").strip():
        return [*shlex.split(os.environ[MPIEXEC_ENV]), "-n", str(ranks)]
    launcher = Path(sys.executable).parent / "mpiexec"
    return [str(launcher) if launcher.exists() else "mpiexec", "-n", str(ranks)]


def bench_worker(ranks: int) -> list[str]:
    """The command that runs ``measuring/bench_worker.py`` on `ranks` ranks; its options follow."""
    return [*mpiexec(ranks), sys.executable, "-m", "measuring.bench_worker"]


def environment(**variables: str) -> dict[str, str]:
    """This process's environment with `variables` set and the experiments' folder first on ``PYTHONPATH``."""
    env = dict(os.environ, **variables)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(EXPERIMENTS), os.environ.get("PYTHONPATH")]))
    return env

"""A launcher for the experiments' own launches, given to them as ``$FSDP_MPI_MPIEXEC`` (mpi_launch.experiments_launcher):
their ranks start warm, as the tests' own do (warm_ranks.py).

    python warm_mpiexec.py MPIEXEC -n RANKS PYTHON PROGRAM...

PROGRAM is a script and its arguments, or ``-m`` and a module: bench.py and predict.py start
``python -m measuring.bench_worker`` and ``python bench_comm.py`` so. This process becomes
``MPIEXEC -n RANKS`` with the rank's command of mpi_launch.python_command, on the servers the test session named
in the environment.
"""

import os
import sys

from mpi_launch import python_command

if __name__ == "__main__":
    launcher, ranks_flag, ranks, _python, *program = sys.argv[1:]
    if ranks_flag != "-n" or not program:
        sys.exit(f"warm_mpiexec: expected MPIEXEC -n RANKS PYTHON PROGRAM..., got {sys.argv[1:]}")
    os.execv(launcher, [launcher, "-n", ranks, *python_command(*program)])

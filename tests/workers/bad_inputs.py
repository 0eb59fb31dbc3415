"""Each bad input of tests/test_experiments.py given to an experiment's entry script in turn, in one job: what a
user's ``mpiexec -n N python experiments/SCRIPT ARGS`` would do with each (its exit code and what it says on
stderr), without starting a job (and importing torch) per case.

    python bad_inputs.py OUT SCRIPT CASES_JSON

CASES_JSON is a list of argument lists; each is run as the script's ``main`` with ``sys.argv`` set to it (argparse
exits with 2; a bad set-up returns 2, as the script's ``sys.exit(main(...))`` passes on). Rank 0 writes OUT: for
each case, the exit code every rank agrees on (else the list) and what the ranks wrote on stderr.
"""

import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

from mpi4py import MPI

EXPERIMENTS = Path(__file__).parents[2] / "experiments"


def exit_code_of(script: dict, parts: tuple) -> int:
    """The script's exit code for its `main` called as the script calls it."""
    try:
        return script["main"](*parts)
    except SystemExit as exit_:  # argparse's error, or a sys.exit on the way
        return exit_.code if isinstance(exit_.code, int) else 1


def main() -> None:
    out, name, cases = Path(sys.argv[1]), sys.argv[2], json.loads(sys.argv[3])
    sys.path.insert(0, str(EXPERIMENTS))
    script = runpy.run_path(str(EXPERIMENTS / name), run_name="bad_inputs")  # its definitions, not its __main__
    parts = {"run_gpt2.py": lambda: (script["GPT2Task"], script["GPT2RunConfig"], script["parser"](), "gpt2")}[name]
    report = []
    for args in cases:
        sys.argv = [str(EXPERIMENTS / name), *args]
        said = io.StringIO()
        with contextlib.redirect_stderr(said):
            code = exit_code_of(script, parts())
        codes = MPI.COMM_WORLD.allgather(code)
        report.append({"args": args, "exit": codes[0] if len(set(codes)) == 1 else codes,
                       "stderr": "".join(MPI.COMM_WORLD.allgather(said.getvalue()))})
    if MPI.COMM_WORLD.rank == 0:
        out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()

"""pytest runs forked from a process that has imported torch already: the mutants' runs (test_mutants.py).

Each mutant runs the tests it names in a pytest of its own, on a copy of the repository. A fresh interpreter
spends 3-5 s of this machine's time importing torch, dynamo and pytest before its first test, which was a
third of the mutants' time. Here one server process (this file, run as a script) imports those libraries once
and forks a child for each run: the child moves to the copy, puts the copy first on sys.path as
`python -m pytest` there would, and runs pytest. Nothing from the repository's own folders is imported before
the fork (the server checks), so each run imports the code of its copy and nothing else.

Protocol: one JSON request per line on the server's stdin ({cwd, args, env, log, timeout}), one JSON reply
per line on its stdout ({returncode}, or {timed_out}). A run's output goes to its log file.
"""

import gc
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
OWN_FOLDERS = tuple(str(REPO / folder) + os.sep for folder in ("fsdp_mpi", "models", "experiments", "tests"))
# What every mutant's run would import first, slowly; and Lightning, where installed, which a run of the Lightning
# strategy's tests imports (3 s).
PRELOADED = ("torch", "torch._dynamo", "numpy", "pytest",
             *(["lightning.pytorch"] if importlib.util.find_spec("lightning") else []))


class WarmPytest:
    """The client: starts the server and runs pytest through it, as `subprocess.run` would."""

    def __init__(self):
        environment = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
        self.server = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                       text=True, cwd=tempfile.gettempdir(), env=environment)

    def run(self, args: list[str], cwd: Path, env: dict, timeout: float) -> subprocess.CompletedProcess:
        """pytest `args` in `cwd` with environment `env`: its exit status and output (stdout and stderr in one);
        raises subprocess.TimeoutExpired where it outlasts `timeout` seconds (it is killed)."""
        with tempfile.NamedTemporaryFile(mode="r", suffix=".log") as log:
            request = dict(cwd=str(cwd), args=args, env=env, log=log.name, timeout=timeout)
            self.server.stdin.write(json.dumps(request) + "\n")
            self.server.stdin.flush()
            reply = self.server.stdout.readline()
            if not reply:
                raise RuntimeError(f"the warm pytest server ended (exit {self.server.wait()}); its errors are above")
            answer, output = json.loads(reply), log.read()
        if answer.get("timed_out"):
            raise subprocess.TimeoutExpired(args, timeout, output=output)
        return subprocess.CompletedProcess(args, answer["returncode"], stdout=output, stderr="")

    def close(self) -> None:
        self.server.stdin.close()
        self.server.wait(timeout=60)


def serve() -> None:
    for name in PRELOADED:
        __import__(name)
    server = sys.modules["__main__"]  # this file, also known as __mp_main__ once multiprocessing is imported
    early = sorted(name for name, module in sys.modules.items()
                   if module is not server and str(getattr(module, "__file__", None) or "").startswith(OWN_FOLDERS))
    if early:
        sys.exit(f"warm_pytest: {early} imported before the fork; the runs would not see their copies' code")
    if sys.modules["torch"].cuda.is_initialized():  # a child could not use CUDA (torch refuses after a fork)
        sys.exit("warm_pytest: CUDA was initialised before the fork")
    gc.freeze()  # the libraries' objects: no run's collections walk them, nor copy their pages
    for line in sys.stdin:
        request = json.loads(line)
        child = os.fork()
        if child == 0:
            run_in_child(request)
        print(json.dumps(wait(child, request["timeout"])), flush=True)


def wait(child: int, timeout: float) -> dict:
    deadline = time.monotonic() + timeout
    while (ended := os.waitpid(child, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            os.killpg(child, signal.SIGKILL)  # the run and whatever it started (mpiexec and its ranks)
            os.waitpid(child, 0)
            return {"timed_out": True}
        time.sleep(0.05)
    return {"returncode": os.waitstatus_to_exitcode(ended[1])}


def run_in_child(request: dict) -> None:
    """Never returns: runs pytest as `python -m pytest` in the request's folder would, and exits with its status."""
    status = 70
    try:
        os.setpgid(0, 0)  # a group of its own, which a timeout kills whole
        log = os.open(request["log"], os.O_WRONLY | os.O_TRUNC)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests' pipe is the server's alone
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        # sys.path[0] is this file's folder (the server's script); `python -m pytest` would put the current
        # folder there, then $PYTHONPATH's entries.
        sys.path[0:1] = [request["cwd"], *filter(None, request["env"].get("PYTHONPATH", "").split(os.pathsep))]
        import pytest
        status = int(pytest.main(request["args"]))
    except BaseException:
        import traceback
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


if __name__ == "__main__":
    serve()

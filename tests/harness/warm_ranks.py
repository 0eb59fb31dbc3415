"""Ranks started warm: forked from a process that has imported torch, where each would import it afresh.

A rank of a test job spends 3-5 s of this machine's time importing torch before its first line of work (a job
of 3 ranks on 2 cores, 6 s), and 1.3-1.9 s more where it makes its first torch optimizer, whose methods load
torch's compiler (dynamo, and sympy with it); a rank of the Lightning strategy's tests or the experiments'
lightning-* strategies about 3 s more importing Lightning; the suite starts several hundred jobs. Here a server
imports them once (Lightning where installed: its import also adds two warning filters, one that hides torch
FSDP1's FutureWarning on ``state_dict_type``, which every warm rank then has), and mpiexec starts this file, as
a client, in place of the rank's script (``mpi_launch.python_command``). The client hands the server its
standard streams, the descriptor through which Hydra (MPICH's launcher) talks to the rank (``PMI_FD``; Open
MPI's rank finds its launcher's daemon through its environment alone), its environment, folder and arguments;
the server forks the rank, which runs the script as ``python script args`` would. The client stays the
launcher's process: it passes signals on to the rank and ends as the rank ends, with its exit status or killed
by the same signal; killed itself, its rank is killed.

Where a warm rank could differ from a cold one, the client execs ``python script`` itself: no server, a
launcher other than the Hydras of MPICH and Intel MPI and Open MPI's (``mpi_launch.warm_launcher`` decides), or an
environment variable that is read while Python, torch and its compiler load (``GLIBC_TUNABLES``,
``OMP_NUM_THREADS``, ``TORCHINDUCTOR_CACHE_DIR``, ...) set otherwise than the server's. A rank that must start
without the compiler loaded (one that checks what fsdp_mpi loads) is started cold: ``FSDP_MPI_WARM_RANKS=0`` in
its launch's environment. Ranks alternate between two servers whose strings hash differently
(``PYTHONHASHSEED``), so that code iterating a set in hash order still differs across ranks, as it does cold.
A warm rank's ``sys.orig_argv`` is the command line its client was started with (``python <this file> script
args``), as a cold rank's is the one it was started with: the ranks that Open MPI's ULFM spawns to grow a run
back run it again, so they start as clients too, warm where the run's ranks are.

Nothing of the repository is imported by the servers (the mutants run copies of it): each rank imports the
code of the script's own checkout.
"""

import contextlib
import gc
import importlib.util
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

SOCKETS_ENV = "FSDP_MPI_WARM_RANKS"  # the servers' sockets, os.pathsep-separated; "0": every rank starts cold
# The second: what torch.optim.Optimizer's first construction loads. The third, where installed: what a rank of
# the Lightning strategy's, Lightning's own or the experiments' lightning-* strategies imports first (3 s).
PRELOADED = ("torch", "torch._dynamo", *(["lightning.pytorch"] if importlib.util.find_spec("lightning") else []))
# Read by the loader, the C libraries or torch while they load: a rank whose value differs starts cold, as does
# one whose value differs for a variable that Python code looked up while the server imported PRELOADED (``Load``).
# (PYTHONHASHSEED: the servers' own; a rank that sets it starts cold.)
READ_AT_LOAD = ("GLIBC_TUNABLES", "LD_", "MALLOC_", "OMP_", "MKL_", "KMP_", "PYTHONMALLOC", "PYTHONOPTIMIZE",
                "PYTHONDEVMODE", "PYTHONWARNINGS", "PYTHONFAULTHANDLER", "TORCH_", "TQDM_", "FSSPEC_")
WALKERS = {("fsspec.config", "set_conf_env")}  # (module, function): see Load
_HEADER = struct.Struct("!Q")
CLIENT = os.path.abspath(__file__)  # what mpiexec starts in place of `python script args`


class WarmRanks:
    """The servers of one test session: started at once and waited for; they end with it, as their stdin closes
    (keep the object for the session: collected, it closes their stdin)."""

    def __init__(self, environment: dict):
        directory = tempfile.mkdtemp(prefix="fsdp_mpi-warm-ranks-")
        self.sockets = [str(Path(directory) / f"server{i}.sock") for i in range(2)]
        first_seed = int.from_bytes(os.urandom(4), "big") % 4_000_000_000
        seeds = [first_seed, first_seed + 1]  # two, and distinct
        self.servers = [subprocess.Popen([sys.executable, __file__, path], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, text=True, cwd=directory,
                                         env={**environment, "PYTHONHASHSEED": str(seed)})
                        for path, seed in zip(self.sockets, seeds)]
        self.ready = all(server.stdout.readline().strip() == "ready" for server in self.servers)


# --- the client: what mpiexec starts, in place of `python script args` -----------------------------------------


def start_rank(script_and_args: list[str]) -> None:  # [script, args...] or ["-m", module, args...]
    """Never returns: the rank runs warm, in a server's child, and this process ends as it does; or cold, in
    this process (exec)."""
    sockets = os.environ.get(SOCKETS_ENV, "").split(os.pathsep)
    rank = int(os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0")
    launched = "PMI_FD" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ
    connection = _connect(sockets[rank % len(sockets)]) if launched and sockets[0] not in ("", "0") else None
    if connection is None:
        _start_cold(script_and_args)
    pmi = [int(os.environ["PMI_FD"])] if "PMI_FD" in os.environ else []
    request = json.dumps({"argv": script_and_args, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
    socket.send_fds(connection, [_HEADER.pack(len(request)) + request], [0, 1, 2, *pmi])
    # The client keeps its copy of the launcher's descriptor until it ends: the launcher takes its closing, with
    # no MPI_Finalize before, for a rank that died.
    replies = connection.makefile("r")
    answer = json.loads(replies.readline() or "{}")
    if "cold" in answer:  # the server found this environment differs from its own where it matters
        connection.close()
        _start_cold(script_and_args)
    child = answer["pid"]
    def forward(number, _frame):
        with contextlib.suppress(ProcessLookupError):  # the child ended; its end is on its way to us
            os.kill(child, number)

    for forwarded in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGCONT):
        signal.signal(forwarded, forward)
    ended = json.loads(replies.readline() or '{"signal": 9}')  # the server gone: as if killed
    if "signal" in ended:
        if ended["signal"] not in (signal.SIGKILL, signal.SIGSTOP):  # those two cannot be caught, nor reset
            signal.signal(ended["signal"], signal.SIG_DFL)
        os.kill(os.getpid(), ended["signal"])
    os._exit(ended.get("exit", 1))


def _start_cold(script_and_args: list[str]) -> None:
    """Never returns: this process becomes `python script args`."""
    os.execv(sys.executable, [sys.executable, *script_and_args])


def _connect(path: str) -> socket.socket | None:
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(path)
    except OSError:
        return None
    return connection


# --- the server ------------------------------------------------------------------------------------------------


def serve(path: str) -> None:
    loaded = Load(PRELOADED)
    repository = Path(__file__).resolve().parents[2]
    own = tuple(str(repository / folder) + os.sep for folder in ("fsdp_mpi", "models", "experiments", "tests"))
    early = sorted(name for name, module in sys.modules.items() if name not in ("__main__", "__mp_main__")
                   and str(getattr(module, "__file__", None) or "").startswith(own))
    if early or sys.modules["torch"].cuda.is_initialized():
        sys.exit(f"warm_ranks: {early or 'CUDA'} loaded before the fork")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the handlers it forks are reaped as they end
    # What the libraries made as they loaded is left out of every collection, the ranks' last included: a
    # rank's interpreter then ends in a fraction of a second, not the second that a cold one spends collecting
    # torch's objects at its end (a third of a short job), and the pages that hold them are never copied.
    gc.freeze()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        readable, _, _ = select.select([listener, sys.stdin], [], [])
        if sys.stdin in readable:  # the session ended: its socket goes, and their folder with the last
            os.unlink(path)
            try:
                os.rmdir(os.path.dirname(path))
            except OSError:
                pass  # the other server's socket is still there
            return
        connection, _ = listener.accept()
        if os.fork() == 0:
            listener.close()
            handle(connection, loaded)  # never returns: the handler exits, the rank it forks ends as python does
        connection.close()


class Load:
    """The server's import of `modules`, and what of its environment it read: the variables that Python code
    looked up in ``os.environ`` meanwhile (by ``[]``, ``get``, ``in`` or ``os.getenv``: torch's and its
    compiler's settings, sympy's, Lightning's rank variables, the temporary folder), which modules read as they
    load and keep. A function that goes through every variable for those it wants is a walker: what it reads is
    not noted, and its module's prefix is named in READ_AT_LOAD instead (noting every variable it passes would
    start every rank cold). tqdm's, imported by torch, walks ``os.environ.items()`` for its TQDM_ settings (the
    lookups then come from the items' ``__iter__``); fsspec's ``set_conf_env``, imported by Lightning, copies
    ``dict(os.environ)`` for its FSSPEC_ ones (WALKERS)."""

    def __init__(self, modules):
        self.before, self.looked_up, look_up = dict(os.environ), set(), os._Environ.__getitem__

        def noting(environment, name):
            caller = sys._getframe(1)
            if caller.f_code.co_name != "__iter__" and (caller.f_globals.get("__name__"),
                                                         caller.f_code.co_name) not in WALKERS:
                self.looked_up.add(name)
            return look_up(environment, name)

        os._Environ.__getitem__ = noting
        try:
            for name in modules:
                __import__(name)
        finally:
            os._Environ.__getitem__ = look_up
        self.after = dict(os.environ)  # with what the libraries set as they loaded (the compiler: its cache folder)

    def read_alike(self, environment: dict) -> bool:
        """Whether `environment` has the server's values for what the loaders, the C libraries and the Python
        code read as they loaded (READ_AT_LOAD's and the variables looked up): as the server started, or as the
        libraries set them themselves (a program that has loaded torch's compiler passes its cache folder on)."""
        read = {*self.looked_up, *(name for name in (*environment, *self.before) if name.startswith(READ_AT_LOAD))}
        return all(environment.get(name) in (self.before.get(name), self.after.get(name)) for name in read)


def handle(connection: socket.socket, loaded: Load) -> None:
    """Never returns (a handler, forked per rank): forks the rank, tells the client its process id, waits for it
    or for the client's end (then kills it), and tells the client how it ended. The rank leaves by SystemExit,
    through this frame and the server's, so that its interpreter ends as a cold one does."""
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        message, fds, _, _ = socket.recv_fds(connection, 1 << 16, 4)
        (length,) = _HEADER.unpack_from(message)
        payload = message[_HEADER.size:]
        while len(payload) < length:
            payload += connection.recv(length - len(payload))
        request = json.loads(payload)
        if not _same_start(request["env"], loaded):
            connection.sendall(b'{"cold": true}\n')
            os._exit(0)
        child = os.fork()
    except BaseException:
        os._exit(70)  # a handler never goes back to serving
    if child == 0:
        connection.close()
        run_rank(request, fds)
    try:
        os.setpgid(child, child)  # as the rank does first: whichever runs first, the group exists for killpg
    except OSError:
        pass
    for fd in fds:
        os.close(fd)
    connection.sendall(json.dumps({"pid": child}).encode() + b"\n")
    rank_ended = os.pidfd_open(child)
    readable, _, _ = select.select([connection, rank_ended], [], [])
    if rank_ended not in readable:  # the client is gone (the launcher killed it): so goes its rank
        os.killpg(child, signal.SIGKILL)
    _, status = os.waitpid(child, 0)
    ended = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}
    try:
        connection.sendall(json.dumps(ended).encode() + b"\n")
    finally:
        os._exit(0)


def _same_start(environment: dict, loaded: Load) -> bool:
    """Whether a rank in `environment` would start as this server did: the same variables read while Python, torch
    and its compiler load (``Load.read_alike``), no PYTHONHASHSEED of its own, and no sitecustomize or
    usercustomize in a folder its PYTHONPATH adds (site imports them as the interpreter starts, which a forked
    rank never does)."""
    added = [folder for folder in _python_path(environment) if folder not in _python_path(loaded.before)]
    customized = any(os.path.exists(os.path.join(folder, f"{name}.py"))
                     for folder in added for name in ("sitecustomize", "usercustomize"))
    return (not customized and "PYTHONHASHSEED" not in environment
            and loaded.read_alike(environment))


def run_rank(request: dict, fds: list[int]) -> None:
    """Never returns: runs the script as `python script args` in the client's folder and environment would,
    on the client's streams, and leaves by SystemExit, which ends its interpreter as that Python's would end."""
    os.setpgid(0, 0)  # a group of its own, killed whole where the client is killed
    # `python script` puts the script's folder first on sys.path, then $PYTHONPATH's entries, then the
    # interpreter's own (this server's, less its own folder and $PYTHONPATH's).
    server_extra = {os.path.abspath(p) for p in [os.path.dirname(__file__), *_python_path(os.environ)]}
    interpreters = [p for p in sys.path if os.path.abspath(p) not in server_extra]
    stdin, stdout, stderr, *pmi = fds
    for fd, standard in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, standard)
        os.close(fd)
    environment = dict(request["env"])
    for fd in pmi:  # Hydra's descriptor, under the number it has here
        environment["PMI_FD"] = str(fd)
        os.set_inheritable(fd, True)
    os.environ.clear()
    os.environ.update(environment)
    os.chdir(request["cwd"])
    # `python -m module args` (the experiments' bench worker) puts the current folder there instead.
    as_module = request["argv"][0] == "-m"
    script, *arguments = request["argv"][as_module:]
    first = os.getcwd() if as_module else os.path.dirname(os.path.abspath(script))
    sys.path[:] = [first, *_python_path(environment), *interpreters]
    sys.argv = [script, *arguments]  # runpy puts the module's file first, as `python -m` does
    sys.orig_argv = [sys.executable, CLIENT, *request["argv"]]  # the client's (ULFM's newcomers run it again)
    if "numpy.random" in sys.modules:  # seeded once, in the server: each rank draws its own, as cold
        sys.modules["numpy.random"].seed()
    try:
        import runpy
        if as_module:
            runpy.run_module(script, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit:
        raise
    except BaseException:
        sys.excepthook(*sys.exc_info())
        raise SystemExit(1)
    # Up through the handler's and the server's frames to the interpreter's own end, as a cold rank's: threads
    # joined, atexit functions, MPI_Finalize (mpi4py's, at Py_AtExit), the modules torn down, then the C
    # library's exit, whose handlers tell Hydra the rank finalized (without them it takes the rank for dead).
    raise SystemExit(0)


def _python_path(environment) -> list[str]:
    return [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p]


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].endswith(".sock"):
        serve(sys.argv[1])
    else:
        start_rank(sys.argv[1:])

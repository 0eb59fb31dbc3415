"""The job: the processes a run's ranks are numbered in, which a grow-back renews.

The job is ``MPI.COMM_WORLD`` as launched. Under ULFM a run may *grow back* after losing
ranks (ULFM's "respawn"): the survivors start one process per lost rank, running this same
program (``MPI_Comm_spawn``), merge with them, and order the merged ranks so that each
newcomer takes the number of the rank it replaces (``Communicator.grow_back`` does the
survivors' part). From then on that communicator is the job, on survivors and newcomers
alike: ranks are numbered in it (in messages, logs and emulated nodes), and
``Communicator()`` means it.

Where the newcomers start: each on the host of the rank it replaces where that rank's node still
has a survivor (in the dead processes' places: Open MPI gives a dead process's slot to nobody,
so they are placed beyond the host's slots, unbound), else in free slots of the allocation (a
spare node's), which the survivors count first (``free_slots``). One spawn starts the newcomers
of one place (``places_of``), and the spawns follow each other: the newcomers of the first take
part in the second, and so on (Open MPI 5.0.11's ``MPI_Comm_spawn_multiple``, one call for
all, refuses a placement per newcomer). Ranks lost on several hosts at once are so each
replaced on its own host.

Slots can be added while the run goes on: a run given a *hosts file* (``add_hosts_from``) reads
it at every step boundary, and where it changed while ranks are missing, the ranks agree to grow
back before the next update (``elastic.agreement``); the spawn hands its hosts to Open MPI's
launcher (``PMIX_ADD_HOST``), which adds them to the allocation, or raises a listed host's slots.

A newcomer's program runs from the top, as the others' did. The first time it asks for the
job (``job_comm``, which ``Communicator()`` does) it finds that it was spawned and joins: it
merges with the survivors and takes its number. That is the survivors' ``spawn_into``, seen
from the other side; nothing else in the program needs to know.
"""

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from mpi4py import MPI

from fsdp_mpi.communication.failures.process_end import exit_without_finalize
from fsdp_mpi.communication.settings import EMULATED_NODE_SIZE, read_count


@dataclass
class _Job:
    """What a process knows of its job (the newcomers are told it as they join)."""

    launched: int  # the processes the launcher started
    placed: int  # the slots the job's processes took: those, and every newcomer started in a free slot since
    hosts: dict[int, str] = field(default_factory=dict)  # each rank's host, as last heard (``note_hosts``)
    replaced: list[int] = field(default_factory=list)  # the ranks this process's grow-backs filled
    hosts_file: str | None = None  # where the user adds hosts while the run goes on (``add_hosts_from``)
    hosts_tried: str | None = None  # its hosts as the last growth tried them (handed to the launcher, or not)
    hosts_misread: str | None = None  # why the hosts file cannot be used, as last said (said once)
    # Each rank's place in the sharding of the last run on every rank of the job: (its index in its shard group,
    # the group's size). Under HYBRID_SHARD and NO_SHARD ranks at the same place hold the same state.
    layout: dict[int, tuple[int, int]] = field(default_factory=dict)


_comm = None  # the job's communicator, once asked for; on a newcomer, once it has joined
_job: _Job | None = None


def job_comm():
    """The job's communicator (an mpi4py one): ``MPI.COMM_WORLD``, or the one the last grow-back made. On a
    newcomer, the first call joins the survivors (collective with their ``spawn_into``)."""
    global _comm, _job
    if _comm is None:
        if is_newcomer():
            _comm = _join()
        else:
            _comm = MPI.COMM_WORLD
            size = _comm.Get_size()
            _job = _Job(size, size)
    return _comm


def is_newcomer() -> bool:
    """Whether this process was started by a grow-back to take a lost rank's place (local)."""
    return MPI.Comm.Get_parent() != MPI.COMM_NULL


def job_rank() -> int:
    """This process's rank in the job: the number launchers, logs and messages give it."""
    return job_comm().Get_rank()


def job_ranks(mpi_comm) -> list[int]:
    """The ranks of `mpi_comm`, numbered as in the job (its dead ranks too: groups outlive processes)."""
    return mpi_comm.Get_group().Translate_ranks(list(range(mpi_comm.Get_size())), job_comm().Get_group())


def replaced_ranks() -> list[int]:
    """The ranks of the job that grow-backs filled with newcomers, as seen by this process (none before it has
    asked for the job)."""
    return list(_job.replaced) if _job is not None else []


def note_hosts(mpi_comm, hosts: list[str]) -> None:
    """Keeps the host of each rank of `mpi_comm` (``hosts``, in its rank order): where a newcomer replacing one
    of them may start, once it is dead."""
    job_comm()
    _job.hosts.update(zip(job_ranks(mpi_comm), hosts))


def node_of(rank: int) -> tuple[str | None, int]:
    """The node of a rank of the job: its host, and its block of ranks where nodes are emulated."""
    job_comm()
    emulated = read_count(EMULATED_NODE_SIZE)
    return _job.hosts.get(rank), rank // emulated if emulated is not None else 0


def place_on_node(rank: int) -> tuple[int, int]:
    """(`rank`'s index among the job's ranks on its node, how many ranks the node runs), from the hosts heard: a
    newcomer started in a dead process's place takes its index there (its GPU), without asking the others."""
    node = node_of(rank)
    mates = [other for other in range(job_comm().Get_size()) if node_of(other) == node]
    return mates.index(rank), len(mates)


def places_of(missing: list[int], alive: list[int]) -> list[tuple[list[int], str | None]]:
    """Where the newcomers replacing the dead ranks `missing` start, as (the ranks, the host) for each place: a
    rank whose node has one of the ranks `alive` on the host heard, on that host; the others in free slots
    (None). The free slots first: a spawn onto a host takes its free slots before it goes beyond them, and would
    leave none for the newcomers that need them. Then hosts in name order, ranks in order: alike on every
    survivor."""
    alive_nodes = {node_of(rank) for rank in alive}
    places: dict[str | None, list[int]] = {}
    for rank in sorted(missing):
        node = node_of(rank)
        places.setdefault(node[0] if node[0] is not None and node in alive_nodes else None, []).append(rank)
    return [(places[host], host) for host in sorted(places, key=lambda host: (host is not None, host or ""))]


def add_hosts_from(path: str | os.PathLike) -> None:
    """Makes `path` the run's hosts file (local; the newcomers are told it): one host a line, ``HOST:SLOTS``
    (``#`` starts a comment), the slots it gives the job. Every spawn hands them to the launcher, and a change
    while ranks are missing makes the ranks grow back at the next step boundary (``hosts_were_added``)."""
    job_comm()
    _job.hosts_file = os.fspath(path)


def added_hosts() -> str | None:
    """The hosts file's hosts as the launcher takes them (``"nodeC:4,nodeD:4"``), or None: no hosts file, an
    empty or missing one. Raises ``ValueError`` naming a line that is not ``HOST:SLOTS``, or why the file cannot
    be read."""
    job_comm()
    try:
        text = Path(_job.hosts_file).read_text() if _job.hosts_file else ""
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as unreadable:
        raise ValueError(f"{_job.hosts_file} cannot be read ({unreadable})") from None
    hosts = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        host, _, slots = line.partition(":")
        if not host or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"{_job.hosts_file}, line {number}: {line!r} is not HOST:SLOTS (a host name, and the "
                             "slots it gives the job, at least 1)")
        hosts.append(f"{host}:{int(slots)}")
    return ",".join(hosts) or None


def hosts_were_added() -> bool:
    """Whether the hosts file lists hosts that no growth has tried yet (local; it reads the file). A file that
    cannot be understood is said once (to stderr) and taken as no change."""
    job_comm()
    if _job.hosts_file is None:
        return False
    try:
        hosts = added_hosts()
    except ValueError as bad:
        if str(bad) != _job.hosts_misread:
            print(f"fsdp_mpi.elastic: the hosts file is not used: {bad}", file=sys.stderr, flush=True)
            _job.hosts_misread = str(bad)
        return False
    return hosts is not None and hosts != _job.hosts_tried


def _hosts_to_add() -> str | None:
    """``added_hosts``, None where there is no hosts file or it cannot be understood (``hosts_were_added`` says
    so)."""
    try:
        return added_hosts()
    except ValueError:
        return None


def hosts_tried() -> None:
    """Notes the hosts file as it is now as tried (local): a growth into it that could not be made is not tried
    again at every step, only once the file changes or at the next loss."""
    job_comm()
    _job.hosts_tried = _hosts_to_add() or _job.hosts_tried


def job_layout(places: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """The places of the job's ranks in the sharding of a run on all of them (its index in its shard group, the
    group's size): `places` where they name every rank of the job (kept), else those last kept. Called alike on
    every rank (the newcomers are told it)."""
    job_comm()
    if set(places) == set(range(_comm.Get_size())):
        _job.layout = dict(places)
    return _job.layout


def ranks_missing(mpi_comm) -> bool:
    """Whether the job has ranks that `mpi_comm` (the ranks training) lacks: lost, and not grown back."""
    return mpi_comm.Get_size() < job_comm().Get_size()


def free_slots() -> int | None:
    """The slots of the allocation that no process of the job has taken: ``MPI_UNIVERSE_SIZE`` (the slots the
    launcher was given) less those taken, by the dead too (Open MPI 5.0.11 gives a dead process's slot to nobody:
    with 3 slots, 3 ranks and one of them dead, a spawn is refused); a newcomer started in a dead process's place
    takes none. None where the launcher started more processes than it has slots (it oversubscribes, and so does
    a spawn), where the hosts file adds hosts (the launcher counts them) or MPI does not say."""
    job_comm()
    if _job.hosts_tried is not None or hosts_were_added():
        return None
    # Asked only here: MPICH started without a launcher starts one to answer (and fails where none is on PATH).
    universe = MPI.COMM_WORLD.Get_attr(MPI.UNIVERSE_SIZE)
    if universe is None or _job.launched > universe:
        return None
    return max(0, universe - _job.placed)


def spawn_into(survivors, places: list[tuple[list[int], str | None]]):
    """The job renewed with a newcomer in each lost rank's place, as `places` (``places_of``) says: (ranks of the
    job, the host they start on in the dead processes' places; None: in free slots); the survivors of `survivors`
    (an mpi4py communicator) keep theirs; made the job. Collective over `survivors`. Raises ``MPI.Exception``
    where newcomers could not start (the same on every survivor; those already started leave)."""
    hosts = survivors.bcast(_hosts_to_add() if survivors.Get_rank() == 0 else None, root=0)  # one reading
    _job.hosts_tried = hosts or _job.hosts_tried  # tried once: a refused spawn is not retried
    merged = _spawn_each(survivors, places, hosts)
    return _become(merged.Split(0, job_rank()), [rank for ranks, _ in places for rank in ranks])


def _spawn_each(spawning, places: list[tuple[list[int], str | None]], hosts: str | None):
    """`spawning` (an intracommunicator) merged with the newcomers of each place in turn, each spawn's newcomers
    taking part in the next; `hosts` handed to the launcher with the first (``PMIX_ADD_HOST``, the hosts file's
    hosts added to the allocation, or a listed host's slots raised, before the newcomers map). Collective over
    `spawning`."""
    for index, (missing, place) in enumerate(places):
        info = MPI.Info.Create()
        info.Set("wdir", os.getcwd())  # the newcomers run this program where it runs, with its arguments
        if hosts is not None and index == 0:
            info.Set("PMIX_ADD_HOST", hosts)
        if place is not None:  # the dead processes' places: their slots are not given back, so beyond the host's
            info.Set("host", place)
            info.Set("map_by", ":OVERSUBSCRIBE")
            info.Set("bind_to", "none")
        try:
            newcomers = spawning.Spawn(sys.executable, args=sys.orig_argv[1:], maxprocs=len(missing), info=info)
        finally:
            info.Free()
        spawning = newcomers.Merge(high=False)  # the spawning ranks first, in their order
        _job.placed += len(missing) if place is None else 0
        spawning.bcast((missing, _job, places[index + 1:]), root=0)
    return spawning


def _join():
    """A newcomer's half of ``spawn_into``: the survivors' job, with this process in the place it was spawned
    to fill (after the spawns of the places that follow its own, in which it takes part). A spawn refused
    there ends it, as the survivors go on without."""
    global _job
    parent = MPI.Comm.Get_parent()
    parent.Set_errhandler(MPI.ERRORS_RETURN)  # a loss meanwhile is an error to handle, not the end of the job
    merged = parent.Merge(high=True)
    missing, _job, later = merged.bcast(None, root=0)
    mine = missing[merged.Get_rank() - parent.Get_remote_size()]
    _job.replaced = []
    try:
        merged = _spawn_each(merged, later, None)
    except MPI.Exception as refused:
        print(f"fsdp_mpi.elastic: the newcomer in rank {mine}'s place leaves: the newcomers after it could not "
              f"start ({refused.Get_error_string()})", file=sys.stderr, flush=True)
        exit_without_finalize(0)
    return _become(merged.Split(0, mine), [mine])


def _become(comm, filled: list[int]):
    global _comm
    comm.Set_errhandler(MPI.ERRORS_RETURN)
    _comm = comm
    _job.replaced.extend(filled)
    return comm

"""Collectives on torch tensors over one MPI communicator: ``Communicator``, the one door to MPI for the layers above.

Each collective checks its buffers, then makes one call: logged, watched for
hangs and checked across ranks in verify mode (``bookkeeping.py``), to the
transport its routes chose for that kind of memory (``routes.py``,
``transports/``). The transport decides how the bytes travel, how the collective
is cut and how sums are taken; this file decides none of that. A collective
started without waiting returns an ``InFlight``: it runs on the communicator's
communication thread, as a nonblocking MPI call, or to its end at once, as the
transport says.

Callers that hand in tensors autograd saved for backward pass ``tensor.data``
aliases: MPI writes do not bump version counters, but staging's copy-back would.
"""

import sys
from collections import Counter
from typing import Callable

import numpy
import torch
from mpi4py import MPI

from fsdp_mpi.communication import point_to_point
from fsdp_mpi.communication.bookkeeping import Collective, Traffic, in_mpi, waiting_in_mpi
from fsdp_mpi.communication.failures.collective_log import PROCESS_LOG
from fsdp_mpi.communication.failures.job import job_comm, spawn_into
from fsdp_mpi.communication.failures.launcher import check_launcher_agrees
from fsdp_mpi.communication.failures.liveness import Liveness
from fsdp_mpi.communication.failures.lost_ranks import RankLostError, continuation_unavailable, failed_ranks
from fsdp_mpi.communication.failures.process_end import exit_without_finalize
from fsdp_mpi.communication.machinery.in_flight import InFlight
from fsdp_mpi.communication.machinery.mpi_library import CudaAwareness, cuda_awareness
from fsdp_mpi.communication.machinery.placement import split_by_node
from fsdp_mpi.communication.machinery.worker import CommunicationThread, threads_may_call_mpi_at_once
from fsdp_mpi.communication.routes import Routes
from fsdp_mpi.communication.settings import (FORCE_STAGING, MAX_ELEMENTS_PER_MESSAGE, NODE_TRANSPORT,
                                             STAGING_CHUNK_BYTES, TIMEOUT, TWO_LEVEL, VERIFY, read_flag,
                                             read_seconds)
from fsdp_mpi.communication.transports.shared_slots import device_bytes_held_by_slots
from fsdp_mpi.communication.transports.transport import Transport

Call = Callable[[Transport], None]
OBJECT_TAG = 30_001  # send_object's messages: above the tags torch's users pick, within MPI's least upper bound


def check_full_and_shard(full: torch.Tensor, shard: torch.Tensor, world_size: int, what: str) -> None:
    """Raises ValueError unless `full` holds `world_size` shards the size of `shard`, and both are contiguous
    and of one dtype (`what`: the collective, for the message)."""
    if full.numel() != shard.numel() * world_size:
        raise ValueError(f"{what}: full buffer has {full.numel()} elements, expected {world_size} x {shard.numel()}")
    if full.dtype != shard.dtype or not (full.is_contiguous() and shard.is_contiguous()):
        raise ValueError(f"{what}: buffers must be contiguous and of one dtype")


class Communicator:
    """Collectives on torch tensors over one MPI communicator (the job's by default: ``MPI.COMM_WORLD``, or the one
    a grow-back renewed, ``failures/job.py``).

    Args:
        mpi_comm: the mpi4py communicator whose ranks share the model.
        force_staging: copy every buffer through host staging buffers even when
            MPI could read it in place. Defaults to ``FSDP_MPI_FORCE_STAGING``.
        node_transport: where ranks share a node, move tensors through memory they
            share instead of through MPI (``transports/node.py``). Defaults to
            ``FSDP_MPI_NODE_TRANSPORT``, else on; forced staging turns it off.
        two_level: where the ranks span nodes, collectives go inside each node, then
            across nodes (``transports/two_level.py``), not in one flat ring.
            Defaults to ``FSDP_MPI_TWO_LEVEL``, else on.
        cuda_aware: whether MPI accepts device buffers. Defaults to asking the
            library (``FSDP_MPI_CUDA_AWARE`` overrides); a split or shrunk
            communicator keeps its parent's decision (a ``CudaAwareness``).
        timeout: seconds a rank may wait in one collective before it reports what
            it waits in and aborts the job; 0 never. Defaults to ``FSDP_MPI_TIMEOUT``, else 600.
        verify: before every collective, check that all ranks enter the same one
            (one extra small reduction each) and raise ``CollectiveMismatchError``,
            naming them, if not. Defaults to ``FSDP_MPI_VERIFY``.
    """

    def __init__(self, mpi_comm=None, *, force_staging: bool | None = None,
                 cuda_aware: bool | CudaAwareness | None = None,
                 node_transport: bool | None = None, two_level: bool | None = None, timeout: float | None = None,
                 verify: bool | None = None):
        if not MPI.Is_initialized():  # a program that set mpi4py.rc.initialize = False and has not yet
            raise RuntimeError("MPI is not initialised: call mpi4py's MPI.Init_thread() before building a Communicator")
        self.mpi_comm = job_comm() if mpi_comm is None else mpi_comm
        self.rank = self.mpi_comm.Get_rank()
        self.world_size = self.mpi_comm.Get_size()
        if self.mpi_comm == MPI.COMM_WORLD:
            check_launcher_agrees(self.world_size)
        self.cuda_awareness = cuda_aware if isinstance(cuda_aware, CudaAwareness) else cuda_awareness(cuda_aware)
        self.force_staging = read_flag(FORCE_STAGING) if force_staging is None else force_staging
        node_transport = read_flag(NODE_TRANSPORT) if node_transport is None else node_transport
        self.node_transport = node_transport and not self.force_staging
        self.two_level = read_flag(TWO_LEVEL) if two_level is None else two_level
        self.timeout = read_seconds(TIMEOUT) if timeout is None else float(timeout)
        self.verify = read_flag(VERIFY) if verify is None else verify
        # Open MPI's nonblocking reductions crash on device buffers: there they run blocking.
        self.device_reductions_in_background = "Open MPI" not in MPI.Get_library_version()
        self.collectives_started = 0  # the next collective's sequence number, the same on every rank
        # How the transports cut collectives, read when each is chosen (tests make them small).
        self.max_elements_per_message = MAX_ELEMENTS_PER_MESSAGE
        self.staging_chunk_bytes = STAGING_CHUNK_BYTES
        self.node_exchange_bytes: int | None = None  # the node transport's exchange; None: its default per device
        self._routes = Routes()  # the transport of each kind of tensor, chosen at its first collective
        self.traffic = Traffic()  # shared with the communicators split from this one
        self._splits: list[Communicator] = []  # revoked with this one when a rank is lost
        # Where the library lets two threads call MPI at once, collectives started early may run there.
        self.communication_thread = CommunicationThread() if threads_may_call_mpi_at_once() else None
        if self.mpi_comm == MPI.COMM_WORLD and PROCESS_LOG.liveness is None:  # every rank builds a first one
            try:
                self.watch_liveness()
            except RankLostError as lost:  # nothing trained yet, nothing to go on from: the whole job ends
                # Every survivor meets the loss in this first collective, and ends itself: after a loss, Open
                # MPI's launcher now and then outlived an MPI_Abort (process_end.exit_without_finalize).
                sys.stderr.write(f"fsdp_mpi: rank(s) {', '.join(map(str, failed_ranks(self.mpi_comm)))} of the "
                                 f"job died as it started ({lost}): ending the job, which has nothing to go on "
                                 "from yet\n")
                exit_without_finalize(1)

    # ----------------------------------------------------------------- routes

    def transport(self, device: torch.device) -> Transport:
        """How tensors on `device` travel between the ranks here (``routes.py``). Collective the first time for
        each kind of tensor, which chooses it; then kept."""
        return self._routes.of(self, device)

    def describe_route(self, device: torch.device) -> str:
        """How `device`'s tensors travel between the ranks here, and why (for a run's log). Collective: it
        chooses the route if no collective has yet."""
        self.transport(device)
        return self._routes.lines[device.type]

    @property
    def cuda_aware(self) -> bool:
        """Whether MPI takes device buffers here (``cuda_awareness`` says why)."""
        return self.cuda_awareness.aware

    @property
    def routes(self) -> dict[str, str]:
        """How each kind of tensor has travelled here so far: {"cpu": "node"}, say (a transport's ``route``)."""
        return {kind: transport.route for kind, transport in self._routes.transports.items()
                if transport.makes_mpi_calls}

    def reserve(self, device: torch.device, nbytes: int) -> None:
        """Prepares, at set-up, for collectives on `device` of up to `nbytes` in their full buffer (collective):
        chooses the route, and grows the node transport's memory now, not at the first large collective of a
        step."""
        self._routes.reserve(self, device, nbytes)

    def close(self) -> None:
        """Gives back the transports' memory, on the device and on the host (collective: every rank calls it). A
        later collective opens it again. Dropping a communicator gives nothing back: device memory that peers
        may still read cannot be freed without them."""
        self._in_program_order()
        self._routes.close(self)

    @staticmethod
    def device_bytes_outside_torch() -> int:
        """Device memory this process holds for node transports (this communicator's and every other's), which
        ``torch.cuda.max_memory_allocated`` does not count: their slots are allocated outside torch's allocator."""
        return device_bytes_held_by_slots()

    @property
    def staging_slots(self) -> list[str]:
        """The host staging buffers used so far (none unless something was staged)."""
        return sorted(name for transport in self._routes.transports.values() for name in transport.staging_slots)

    @property
    def seconds_in_mpi(self) -> float:
        """Wall time this rank spent blocked in MPI calls here or in communicators split from here."""
        return self.traffic.seconds_in_mpi

    @property
    def bytes_moved(self) -> Counter:
        """Bytes per operation moved here or in communicators split from here (see ``Traffic``)."""
        return self.traffic.bytes_moved

    # ----------------------------------------------------------------- collectives
    # `unit` names the sharded unit a collective serves, for the collective log and verify mode.

    def all_gather_into(self, full: torch.Tensor, shard: torch.Tensor, unit: str = "") -> None:
        """full (world_size * S,) <- every rank's shard (S,), in rank order."""
        check_full_and_shard(full, shard, self.world_size, "all_gather_into")
        self._run(Collective("all_gather", shard, full, unit), lambda transport: transport.all_gather(full, shard))

    def reduce_scatter_sum(self, shard: torch.Tensor, full: torch.Tensor, unit: str = "") -> None:
        """shard (S,) <- sum over ranks of their full[rank * S:(rank + 1) * S].

        A sum, as MPI computes it: the sharding layer makes it a mean by scaling the
        gradient as backward assembles it (``flat_param``), which costs no pass of its own.
        """
        check_full_and_shard(full, shard, self.world_size, "reduce_scatter_sum")
        self._run(Collective("reduce_scatter", full, full, unit, summed=True),
                  lambda transport: transport.reduce_scatter(shard, full))

    def all_reduce_sum_(self, tensor: torch.Tensor, unit: str = "") -> None:
        """tensor <- its element-wise sum over ranks, in place (the replicas of HYBRID_SHARD and NO_SHARD,
        metrics)."""
        if not tensor.is_contiguous():
            raise ValueError("all_reduce_sum_ needs a contiguous tensor")
        flat = tensor.view(-1)
        self._run(Collective("all_reduce", flat, flat, unit, summed=True), lambda transport: transport.all_reduce(flat))

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor, unit: str = "") -> None:
        """received (world_size * K,) <- chunk `rank` of every rank's `sent` (world_size * K,), in rank order:
        chunk j of `sent` (elements [j*K, (j+1)*K)) goes to rank j. It moves bits, no arithmetic: the
        compressed gradient reduction (``compression.py``) sends encoded chunks and sums them itself."""
        if received.numel() != sent.numel() or sent.numel() % self.world_size:
            raise ValueError(f"all_to_all: {sent.numel()} elements sent, {received.numel()} received: both must be "
                             f"the same multiple of {self.world_size} ranks")
        if received.dtype != sent.dtype or not (received.is_contiguous() and sent.is_contiguous()):
            raise ValueError("all_to_all: buffers must be contiguous and of one dtype")
        self._run(Collective("all_to_all", sent, sent, unit), lambda transport: transport.all_to_all(received, sent))

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Overwrites `tensor` on every rank with root's."""
        if not tensor.is_contiguous():
            raise ValueError("broadcast_ needs a contiguous tensor")
        flat = tensor.view(-1)
        self._run(Collective("broadcast", flat, flat), lambda transport: transport.broadcast(flat, root))

    def start_all_gather_into(self, full: torch.Tensor, shard: torch.Tensor, unit: str = "") -> InFlight:
        """Like ``all_gather_into``, returning before the data has arrived: ``wait()`` before reading `full`."""
        check_full_and_shard(full, shard, self.world_size, "start_all_gather_into")
        transport = self.transport(full.device)
        return self._start(Collective("all_gather", shard, full, unit), lambda t: t.all_gather(full, shard),
                           transport.nonblocking_all_gather(full, shard), keep=(full, shard))

    def start_reduce_scatter_sum(self, shard: torch.Tensor, full: torch.Tensor, unit: str = "") -> InFlight:
        """Like ``reduce_scatter_sum``, returning at once: `shard` holds the sum after ``wait()``. Handed to the
        communication thread, 16-bit values that MPI sums go as fp32 copies made here, on the caller's stream:
        made there, on its side stream, they would come from a share of the caching allocator that the compute
        stream cannot reuse (a gradient-sized block held apart per unit)."""
        check_full_and_shard(full, shard, self.world_size, "start_reduce_scatter_sum")
        transport, finish = self.transport(full.device), None
        if self._on_the_worker(transport, full):
            shard, full, finish = transport.widened_for_sum(shard, full)
        return self._start(Collective("reduce_scatter", full, full, unit, summed=True),
                           lambda t: t.reduce_scatter(shard, full), transport.nonblocking_reduce_scatter(shard, full),
                           keep=(full, shard)).then(finish)

    # ----------------------------------------------------------------- messages between two ranks

    def start_send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> InFlight:
        """Starts sending `tensor` to rank `peer` (``point_to_point.py``); ``wait()`` before changing it."""
        return point_to_point.start_send(self, tensor, peer, tag)

    def start_receive(self, tensor: torch.Tensor, peer: int | None = None, tag: int = 0) -> InFlight:
        """Starts receiving into `tensor` from rank `peer`, or from any rank (None); ``wait()`` returns the rank
        it came from."""
        return point_to_point.start_receive(self, tensor, peer, tag)

    # ----------------------------------------------------------------- objects and numbers (pickled, small)

    def all_gather_object(self, obj) -> list:
        """Every rank's small picklable `obj`, in rank order (for checks, not tensors)."""
        return self._pickled("all_gather_object", lambda: self.mpi_comm.allgather(obj), alone=[obj])

    def broadcast_object(self, obj, root: int = 0):
        """Root's small picklable `obj` on every rank (settings, error messages, a port number)."""
        return self._pickled("broadcast_object", lambda: self.mpi_comm.bcast(obj, root=root), alone=obj)

    def all_reduce_sum_float(self, value: float) -> float:
        """Sum of a Python float over ranks (losses, counters)."""
        return self._all_reduce_float("all_reduce_sum", value, MPI.SUM)

    def all_reduce_max_float(self, value: float) -> float:
        """Maximum of a Python float over ranks."""
        return self._all_reduce_float("all_reduce_max", value, MPI.MAX)

    def all_reduce_min_float(self, value: float) -> float:
        """Minimum of a Python float over ranks."""
        return self._all_reduce_float("all_reduce_min", value, MPI.MIN)

    def _all_reduce_float(self, operation: str, value: float, op) -> float:
        """One float reduced over the ranks, as a buffer through ``MPI_Allreduce`` on this communicator. Not
        mpi4py's pickled ``allreduce``: it reduces through messages on a duplicate of the communicator, which
        revoking this one leaves as it is, so a survivor waiting there for a lost rank waited for ever (seen
        under ULFM with 4 ranks: the other survivors revoked and went on to agree)."""
        number = numpy.array([float(value)])

        def reduce() -> float:
            self.mpi_comm.Allreduce(MPI.IN_PLACE, number, op=op)
            return float(number[0])
        return self._pickled(operation, reduce, alone=float(value), numel=1, dtype="float64")

    def barrier(self) -> None:
        self._pickled("barrier", self.mpi_comm.Barrier, alone=None)

    def holds_the_ranks_of(self, other: "Communicator") -> bool:
        """Whether `other` holds the same processes in the same order (MPI's identical or congruent)."""
        return MPI.Comm.Compare(self.mpi_comm, other.mpi_comm) in (MPI.IDENT, MPI.CONGRUENT)

    def split(self, color: int | None) -> "Communicator | None":
        """A communicator over the ranks that pass the same `color` (None: the ranks of this node), in rank
        order, with this one's settings; None for a rank that passes ``MPI.UNDEFINED``. A group of one rank is
        its own only split."""
        if self.world_size == 1:  # one rank: no MPI call, as the OneRank transport makes none
            return None if color == MPI.UNDEFINED else self
        sub = self._pickled("split", lambda: split_by_node(self.mpi_comm) if color is None
                            else self.mpi_comm.Split(color, self.rank), alone=None)
        if sub == MPI.COMM_NULL:
            return None
        child = Communicator(sub, force_staging=self.force_staging, cuda_aware=self.cuda_awareness,
                             node_transport=self.node_transport, two_level=self.two_level, timeout=self.timeout,
                             verify=self.verify)
        child.traffic, child.node_exchange_bytes = self.traffic, self.node_exchange_bytes
        self._splits.append(child)
        return child

    # ----------------------------------------------------------------- going on without a lost rank

    def agree(self, flags: int = 1) -> int:
        """`flags` (bits) and-ed over the ranks, the same answer on every survivor (ULFM's ``MPI_Comm_agree``):
        raises ``RankLostError`` on every one of them alike if a rank has been lost. A training loop that agrees
        before its optimizer step knows that every survivor takes the step, or none does
        (``failures/lost_ranks.py``)."""
        return self._pickled("agree", lambda: self.mpi_comm.Agree(flags), alone=flags)

    def revoke(self) -> None:
        """After ``RankLostError``: makes every call on this communicator, on those split from it and on their
        transports fail at once on every rank, so that no survivor goes on waiting for a partner that has given
        up. Local; a communicator already revoked, or gone, is left as it is. Its transports are dropped without
        their collective close (the peers are gone, or going on elsewhere): their memory, the node transport's
        slots, goes with the last reference, not with the communicator, which the loop may keep to the end."""
        for mpi_comm in [self.mpi_comm, *self._routes.mpi_comms]:
            try:
                mpi_comm.Revoke()
            except MPI.Exception:
                pass
        self._routes.transports.clear()
        for child in self._splits:
            child.revoke()

    def watch_liveness(self) -> None:
        """Lets the watchdog ask these ranks, when a collective hangs, which of them still answer (collective).
        The first world communicator does it as it is built; survivors once they have settled after ``shrink``.
        Nothing where a thread cannot call MPI beside the main one, or alone."""
        if self.world_size > 1 and self.communication_thread is not None:  # one rank: nobody else to ask
            with in_mpi(self, "watch who answers", collective=False):
                liveness = Liveness(self.mpi_comm)
            PROCESS_LOG.start_answering(liveness)

    def shrink(self) -> "Communicator":
        """After ``RankLostError``: a communicator, with this one's settings, over the ranks of this one still
        alive, in the same order (collective over them). Revokes this one first. Until the survivors call
        ``watch_liveness`` the watchdog reports a hang without asking who is still there. Refused, naming why,
        where MPI cannot report a lost rank (``continuation_unavailable``)."""
        unavailable = continuation_unavailable()
        if unavailable:
            raise RuntimeError(f"cannot go on without the lost rank: {unavailable}")
        self.revoke()
        with in_mpi(self, "shrink to the survivors", collective=False):  # watched: a survivor may never come
            shrunk = self.mpi_comm.Shrink()
        survivors = Communicator(shrunk, force_staging=self.force_staging, cuda_aware=self.cuda_awareness,
                                 node_transport=self.node_transport, two_level=self.two_level,
                                 timeout=self.timeout, verify=self.verify)
        survivors.node_exchange_bytes = self.node_exchange_bytes
        return survivors

    def grow_back(self, places: list[tuple[list[int], str | None]]) -> "Communicator":
        """After ``shrink``, on its survivors: the job grown back, a newcomer running this program started in each
        lost rank's place, as `places` says (ranks of the job, and the host they start on; None: in free slots,
        ``failures/job.places_of``), and the survivors in theirs, with this one's settings; from now on the job
        (``failures/job.py``). Collective over these ranks, and the newcomers'. Raises ``MPI.Exception`` on every
        rank alike where a newcomer could not start."""
        newcomers = sum(len(ranks) for ranks, _ in places)
        with in_mpi(self, f"start {newcomers} newcomer(s) and merge", collective=False):
            job = spawn_into(self.mpi_comm, places)
        grown = Communicator(job, force_staging=self.force_staging, cuda_aware=self.cuda_awareness,
                             node_transport=self.node_transport, two_level=self.two_level, timeout=self.timeout,
                             verify=self.verify)
        grown.node_exchange_bytes = self.node_exchange_bytes
        return grown

    def send_object(self, obj, peer: int) -> None:
        """Sends picklable `obj` (tensors and all: a rank's whole state) to rank `peer`: messages, not a
        collective (``receive_object`` takes it). Its tensors travel as their own bytes (``point_to_point``)."""
        point_to_point.send_object(self, obj, peer, OBJECT_TAG)

    def receive_object(self, peer: int):
        """The object rank `peer` sends with ``send_object``."""
        return point_to_point.receive_object(self, peer, OBJECT_TAG)

    # ----------------------------------------------------------------- the one call

    def _in_program_order(self) -> None:
        """What was handed to the communication thread finishes first: the ranks enter this communicator's
        collectives in program order, whichever thread issues them (``machinery/worker.py``)."""
        if self.communication_thread is not None:
            self.communication_thread.wait_for_all()

    def _run(self, collective: Collective, call: Call) -> None:
        """One collective: `call` on the transport of its buffer's memory, logged, watched and counted (the
        buffer's bytes, widened where the transport sums 16-bit values through fp32); a group of one rank just
        calls. A collective of no elements moves nothing: every rank has none (their counts must agree), and
        none calls."""
        buffer = collective.buffer
        transport = self.transport(buffer.device)
        if buffer.numel() == 0:
            return
        if not transport.makes_mpi_calls:
            call(transport)
            return
        self._in_program_order()
        counted = transport.summed_bytes(buffer) if collective.summed else buffer.nbytes
        self.bytes_moved[collective.operation] += counted
        with in_mpi(self, collective.operation, collective.sent, collective.unit):
            call(transport)

    def _on_the_worker(self, transport: Transport, buffer: torch.Tensor) -> bool:
        return (self.communication_thread is not None and transport.makes_mpi_calls
                and transport.runs_started_on_the_worker(buffer))

    def _start(self, collective: Collective, call: Call, nonblocking: Callable | None, keep: tuple) -> InFlight:
        """A started collective: on the communication thread, where the transport says so; else as MPI's
        nonblocking call, where the transport makes one for these buffers (`nonblocking` starts it and returns
        its request); else run to its end now. The started one keeps the tensors of `keep` alive."""
        buffer = collective.buffer
        if buffer.numel() == 0:
            return InFlight()
        transport = self.transport(buffer.device)
        if self._on_the_worker(transport, buffer):
            return self.communication_thread.start(lambda: self._run(collective, call), buffer.device, keep=keep)
        if nonblocking is None or not transport.makes_mpi_calls:
            self._run(collective, call)
            return InFlight()
        self._in_program_order()
        self.bytes_moved[collective.operation] += buffer.nbytes
        with in_mpi(self, collective.operation, collective.sent, collective.unit, finishes=False) as record:
            request = nonblocking()

        def completed() -> None:
            with waiting_in_mpi(self, record):
                request.Wait()
        return InFlight(steps=(completed,), keep=keep)

    def _pickled(self, operation: str, call: Callable, alone, **logged):
        """An MPI call on pickled objects or numbers, logged and watched; `alone` on a group of one rank, with no
        call."""
        if self.world_size == 1:  # one rank: objects go nowhere, as the OneRank transport's tensors
            return alone
        self._in_program_order()
        with in_mpi(self, operation, **logged):
            return call()

"""Collectives on torch tensors over one MPI communicator: ``Communicator``, the one door to MPI for the layers above.

Each collective checks its buffers, then takes its tensors' route (``routes.py``):
through the node's shared memory, staged through pinned host buffers, or straight
to MPI, cut into messages within MPI's count limit. How a tensor becomes an MPI
buffer is ``mpi_buffers.py``; the log, verify mode, hang watch and timing around
every call are ``bookkeeping.py``; a collective started without waiting returns a
``Pending`` (``started.py``).

A group of one rank makes no MPI call at all: gathering is a copy (or nothing,
when the buffers are one), reducing leaves the values as they are, and objects
and floats come back unchanged. So one rank is plain torch plus the wrapper's
bookkeeping, on the GPU with nothing staged and nothing synchronised.

Callers that hand in tensors autograd saved for backward pass ``tensor.data``
aliases: MPI writes do not bump version counters, but staging's copy-back would.
"""

from collections import Counter
from functools import partial

import torch
from mpi4py import MPI

from fsdp_mpi.communication.background import CommunicationThread, threads_may_call_mpi_at_once
from fsdp_mpi.communication.bookkeeping import Traffic, in_mpi
from fsdp_mpi.communication.collective_log import PROCESS_LOG, timeout_from_environment
from fsdp_mpi.communication.gpu_support import mpi_is_cuda_aware
from fsdp_mpi.communication.launcher import check_launcher_agrees
from fsdp_mpi.communication.liveness import Liveness
from fsdp_mpi.communication.mpi_buffers import (MAX_ELEMENTS_PER_MESSAGE, SUM_IN_FP32, as_bits, as_numbers,
                                                check_full_and_shard, wait_for_producer)
from fsdp_mpi.communication.routes import STAGING_CHUNK_BYTES, Route, Routes, staging_chunk_numel
from fsdp_mpi.communication.settings import FORCE_STAGING, NODE_TRANSPORT, VERIFY, read_flag
from fsdp_mpi.communication.shared_slots import device_bytes_held_by_slots
from fsdp_mpi.communication.staging import StagedCollectives
from fsdp_mpi.communication.started import Pending, start_all_gather, start_reduce_scatter


class Communicator:
    """Collectives on torch tensors over one MPI communicator (``MPI.COMM_WORLD`` by default).

    Args:
        mpi_comm: the mpi4py communicator whose ranks share the model.
        force_staging: copy every buffer through host staging buffers even when
            MPI could read it in place. Defaults to ``FSDP_MPI_FORCE_STAGING``.
        node_transport: where every rank is on this node, move tensors through memory the
            ranks share (``node_transport.py``) instead of through MPI. Defaults to
            ``FSDP_MPI_NODE_TRANSPORT``, else on; forced staging turns it off.
        cuda_aware: whether MPI accepts device buffers. Defaults to asking the
            library (``FSDP_MPI_CUDA_AWARE`` overrides).
        timeout: seconds a rank may wait in one collective before it reports what
            it waits in and aborts the job; 0 never. Defaults to ``FSDP_MPI_TIMEOUT``, else 600.
        verify: before every collective, check that all ranks enter the same one
            (one extra small reduction each) and raise ``CollectiveMismatchError``,
            naming them, if not. Defaults to ``FSDP_MPI_VERIFY``.
    """

    def __init__(self, mpi_comm=None, *, force_staging: bool | None = None, cuda_aware: bool | None = None,
                 node_transport: bool | None = None, timeout: float | None = None, verify: bool | None = None):
        if not MPI.Is_initialized():  # a program that set mpi4py.rc.initialize = False and has not yet
            raise RuntimeError("MPI is not initialised: call mpi4py's MPI.Init_thread() before building a Communicator")
        self.mpi_comm = MPI.COMM_WORLD if mpi_comm is None else mpi_comm
        self.rank = self.mpi_comm.Get_rank()
        self.world_size = self.mpi_comm.Get_size()
        if self.mpi_comm == MPI.COMM_WORLD:
            check_launcher_agrees(self.world_size)
        self.cuda_aware = mpi_is_cuda_aware() if cuda_aware is None else cuda_aware
        self.force_staging = bool(read_flag(FORCE_STAGING)) if force_staging is None else force_staging
        if node_transport is None:
            node_transport = read_flag(NODE_TRANSPORT) is not False
        self.node_transport = node_transport and not self.force_staging
        self.timeout = timeout_from_environment() if timeout is None else float(timeout)
        self.verify = bool(read_flag(VERIFY)) if verify is None else verify
        # Open MPI's nonblocking reductions crash on device buffers: there they run blocking.
        self.device_reductions_in_background = "Open MPI" not in MPI.Get_library_version()
        self.collectives_started = 0  # the next collective's sequence number, the same on every rank
        self.max_elements_per_message = MAX_ELEMENTS_PER_MESSAGE
        self.staging_chunk_bytes = STAGING_CHUNK_BYTES
        self.node_exchange_bytes: int | None = None  # the node transport's chunk; None: its default per device
        self._routes = Routes()  # how each kind of tensor travels, chosen at its first collective (``route``)
        self.traffic = Traffic()  # shared with the communicators split from this one
        self._staged = StagedCollectives()
        # Where the library lets two threads call MPI at once, staged collectives started early run there.
        self.communication_thread = CommunicationThread() if threads_may_call_mpi_at_once() else None
        if (self.mpi_comm == MPI.COMM_WORLD and self.world_size > 1 and self.communication_thread is not None
                and PROCESS_LOG.liveness is None):  # collective: every rank builds a first world Communicator
            PROCESS_LOG.start_answering(Liveness(self.mpi_comm))  # so the watchdog can ask who is still there

    def describe_route(self, device: torch.device) -> str:
        """How `device`'s tensors travel between the ranks here, and why (for a run's log). Collective: it
        chooses the route if no collective has yet."""
        return self._routes.describe(self, device)

    def route(self, device: torch.device) -> Route:
        """How tensors on `device` travel between the ranks here (``routes.py``). Collective the first time for
        each kind of tensor, which chooses the route; then kept."""
        return self._routes.of(self, device)

    def reserve(self, device: torch.device, nbytes: int) -> None:
        """Prepares, at set-up, for collectives on `device` of up to `nbytes` in their full buffer (collective): chooses
        the route, and grows the node transport's memory now, not at the first large collective of a step."""
        self._routes.reserve(self, device, nbytes)

    @staticmethod
    def device_bytes_outside_torch() -> int:
        """Device memory this process holds for node transports (this communicator's and every other's), which
        ``torch.cuda.max_memory_allocated`` does not count: their slots are allocated outside torch's allocator."""
        return device_bytes_held_by_slots()

    def close(self) -> None:
        """Gives back the node transport's memory, on the device and on the host (collective: every rank
        calls it). A later collective opens it again. Dropping a communicator gives nothing back: device memory
        that peers may still read cannot be freed without them."""
        self._routes.close(self)

    @property
    def routes(self) -> dict[str, str]:
        """How each kind of tensor has travelled here so far: {"cpu": "node"}, say (see ``Route``)."""
        return {kind: route.value for kind, route in self._routes.chosen.items()}

    @property
    def staging_slots(self) -> list[str]:
        """The host staging buffers used so far (none unless something was staged)."""
        return self._staged.buffers.slots

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
        shard_numel = shard.numel()
        check_full_and_shard(full, shard, self.world_size, "all_gather_into")
        if self.world_size == 1:
            _copy_unless_same(full, shard)
            return
        route = self.route(full.device)
        if route is Route.NODE:
            self.bytes_moved["all_gather"] += full.numel() * full.element_size()
            with in_mpi(self, "all_gather", shard, unit):
                self._routes.node_transports[full.device.type].all_gather(full, shard)
            return
        if route is Route.STAGED:
            self.bytes_moved["all_gather"] += full.numel() * full.element_size()
            with in_mpi(self, "all_gather", shard, unit):
                self._staged.all_gather(full, shard, self._staging_chunk_numel(shard), self._mpi_all_gather)
            return
        chunk = self.max_elements_per_message
        if shard_numel <= chunk:
            self._all_gather_message(full, shard, unit)
            return
        full_by_rank = full.view(self.world_size, shard_numel)
        for start in range(0, shard_numel, chunk):
            stop = min(start + chunk, shard_numel)
            gathered = torch.empty(self.world_size, stop - start, dtype=full.dtype, device=full.device)
            self._all_gather_message(gathered, shard[start:stop], unit)
            full_by_rank[:, start:stop].copy_(gathered)

    def reduce_scatter_sum(self, shard: torch.Tensor, full: torch.Tensor, unit: str = "") -> None:
        """shard (S,) <- sum over ranks of their full[rank * S:(rank + 1) * S].

        A sum, as MPI computes it: the sharding layer makes it a mean by scaling the
        gradient as backward assembles it (``flat_param``), which costs no pass of its own.
        """
        check_full_and_shard(full, shard, self.world_size, "reduce_scatter_sum")
        if self.world_size == 1:
            _copy_unless_same(shard, full)
            return
        if self.route(full.device) is Route.NODE:  # sends 16-bit values as they are, sums them in fp32
            self.bytes_moved["reduce_scatter"] += full.numel() * full.element_size()
            with in_mpi(self, "reduce_scatter", full, unit):
                self._routes.node_transports[full.device.type].reduce_scatter(shard, full)
            return
        if shard.dtype in SUM_IN_FP32:
            shard_fp32 = torch.empty(shard.numel(), dtype=torch.float32, device=shard.device)
            self.reduce_scatter_sum(shard_fp32, full.float(), unit)
            shard.copy_(shard_fp32)
            return
        if self.route(full.device) is Route.STAGED:
            self.bytes_moved["reduce_scatter"] += full.numel() * full.element_size()
            with in_mpi(self, "reduce_scatter", full, unit):
                self._staged.reduce_scatter(shard, full, self._staging_chunk_numel(shard), self._mpi_reduce_scatter)
            return
        shard_numel = shard.numel()
        chunk = self.max_elements_per_message
        if shard_numel <= chunk:
            self._reduce_scatter_message(shard, full, unit)
            return
        full_by_rank = full.view(self.world_size, shard_numel)
        for start in range(0, shard_numel, chunk):
            stop = min(start + chunk, shard_numel)
            self._reduce_scatter_message(shard[start:stop], full_by_rank[:, start:stop].contiguous(), unit)

    def all_reduce_sum_(self, tensor: torch.Tensor, unit: str = "") -> None:
        """tensor <- its element-wise sum over ranks, in place (the replicas of HYBRID_SHARD and NO_SHARD,
        metrics)."""
        if self.world_size == 1:
            return
        if not tensor.is_contiguous():
            raise ValueError("all_reduce_sum_ needs a contiguous tensor")
        if self.route(tensor.device) is Route.NODE:
            flat = tensor.view(-1)
            self.bytes_moved["all_reduce"] += flat.numel() * flat.element_size()
            with in_mpi(self, "all_reduce", flat, unit):
                self._routes.node_transports[flat.device.type].all_reduce(flat)
            return
        if tensor.dtype in SUM_IN_FP32:
            tensor_fp32 = tensor.float()
            self.all_reduce_sum_(tensor_fp32, unit)
            tensor.copy_(tensor_fp32)
            return
        flat = tensor.view(-1)
        self.bytes_moved["all_reduce"] += flat.numel() * flat.element_size()
        if self.route(flat.device) is Route.STAGED:
            with in_mpi(self, "all_reduce", flat, unit):
                self._staged.in_place(flat, self._staging_chunk_numel(flat), self._mpi_all_reduce, slot="all_reduce")
            return
        for start in range(0, flat.numel(), self.max_elements_per_message):
            part = flat[start:start + self.max_elements_per_message]
            with in_mpi(self, "all_reduce", part, unit):
                wait_for_producer(part)
                self._mpi_all_reduce(part)

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor, unit: str = "") -> None:
        """received (world_size * K,) <- chunk `rank` of every rank's `sent` (world_size * K,), in rank order:
        chunk j of `sent` (elements [j*K, (j+1)*K)) goes to rank j. It moves bits, no arithmetic: the
        compressed gradient reduction (``compression.py``) sends encoded chunks and sums them itself."""
        if received.numel() != sent.numel() or sent.numel() % self.world_size:
            raise ValueError(f"all_to_all: {sent.numel()} elements sent, {received.numel()} received: both must be "
                             f"the same multiple of {self.world_size} ranks")
        if received.dtype != sent.dtype or not (received.is_contiguous() and sent.is_contiguous()):
            raise ValueError("all_to_all: buffers must be contiguous and of one dtype")
        if self.world_size == 1:
            _copy_unless_same(received, sent)
            return
        self.bytes_moved["all_to_all"] += sent.numel() * sent.element_size()
        route = self.route(sent.device)
        if route is Route.NODE:
            with in_mpi(self, "all_to_all", sent, unit):
                self._routes.node_transports[sent.device.type].all_to_all(received, sent)
            return
        if route is Route.STAGED:
            with in_mpi(self, "all_to_all", sent, unit):
                self._staged.all_to_all(received, sent, self.world_size, self._staging_chunk_numel(sent),
                                        self._mpi_all_to_all)
            return
        chunk_numel = sent.numel() // self.world_size
        sent_by_rank, received_by_rank = sent.view(self.world_size, -1), received.view(self.world_size, -1)
        for start in range(0, chunk_numel, self.max_elements_per_message):
            stop = min(start + self.max_elements_per_message, chunk_numel)
            whole = stop - start == chunk_numel
            send = sent if whole else sent_by_rank[:, start:stop].contiguous()
            receive = received if whole else torch.empty_like(send)
            with in_mpi(self, "all_to_all", send, unit):
                wait_for_producer(send)
                self._mpi_all_to_all(receive, send)
            if not whole:
                received_by_rank[:, start:stop].copy_(receive)

    def split(self, color: int | None) -> "Communicator":
        """A communicator over the ranks that pass the same `color` (None: the ranks of this node), in rank
        order, with this one's settings. A group of one rank is its own only split."""
        if self.world_size == 1:
            return self
        with in_mpi(self, "split"):
            if color is None:
                sub = self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, self.rank)
            else:
                sub = self.mpi_comm.Split(color, self.rank)
        child = Communicator(sub, force_staging=self.force_staging, cuda_aware=self.cuda_aware,
                             node_transport=self.node_transport, timeout=self.timeout, verify=self.verify)
        child.traffic, child.node_exchange_bytes = self.traffic, self.node_exchange_bytes
        return child

    def start_all_gather_into(self, full: torch.Tensor, shard: torch.Tensor, unit: str = "") -> Pending:
        """Like ``all_gather_into``, returning before the data has arrived: ``wait()`` before reading `full`
        (how it runs meanwhile: ``started.start_all_gather``)."""
        return start_all_gather(self, full, shard, unit)

    def start_reduce_scatter_sum(self, shard: torch.Tensor, full: torch.Tensor, unit: str = "") -> Pending:
        """Like ``reduce_scatter_sum``, returning at once: `shard` holds the sum after ``wait()``
        (how it runs meanwhile: ``started.start_reduce_scatter``)."""
        return start_reduce_scatter(self, shard, full, unit)

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Overwrites `tensor` on every rank with root's."""
        if not tensor.is_contiguous():
            raise ValueError("broadcast_ needs a contiguous tensor")
        if self.world_size == 1:
            return
        flat = tensor.view(-1)
        self.bytes_moved["broadcast"] += flat.numel() * flat.element_size()
        broadcast = partial(self._mpi_broadcast, root=root)
        route = self.route(flat.device)
        if route is Route.NODE:
            with in_mpi(self, "broadcast", flat):
                self._routes.node_transports[flat.device.type].broadcast(flat, root)
            return
        if route is Route.STAGED:
            with in_mpi(self, "broadcast", flat):
                self._staged.in_place(flat, self._staging_chunk_numel(flat), broadcast, send=self.rank == root,
                                      receive=self.rank != root, slot="broadcast")
            return
        for start in range(0, max(flat.numel(), 1), self.max_elements_per_message):
            part = flat[start:start + self.max_elements_per_message]
            with in_mpi(self, "broadcast", part):
                wait_for_producer(part)
                broadcast(part)

    def all_gather_object(self, obj) -> list:
        """Every rank's small picklable `obj`, in rank order (for checks, not tensors)."""
        if self.world_size == 1:
            return [obj]
        with in_mpi(self, "all_gather_object"):
            return self.mpi_comm.allgather(obj)

    def broadcast_object(self, obj, root: int = 0):
        """Root's small picklable `obj` on every rank (settings, error messages, a port number)."""
        if self.world_size == 1:
            return obj
        with in_mpi(self, "broadcast_object"):
            return self.mpi_comm.bcast(obj, root=root)

    def all_reduce_sum_float(self, value: float) -> float:
        """Sum of a Python float over ranks (losses, counters)."""
        if self.world_size == 1:
            return float(value)
        with in_mpi(self, "all_reduce_sum", numel=1, dtype="float64"):
            return self.mpi_comm.allreduce(float(value), op=MPI.SUM)

    def all_reduce_max_float(self, value: float) -> float:
        """Maximum of a Python float over ranks."""
        if self.world_size == 1:
            return float(value)
        with in_mpi(self, "all_reduce_max", numel=1, dtype="float64"):
            return self.mpi_comm.allreduce(float(value), op=MPI.MAX)

    def all_reduce_min_float(self, value: float) -> float:
        """Minimum of a Python float over ranks."""
        if self.world_size == 1:
            return float(value)
        with in_mpi(self, "all_reduce_min", numel=1, dtype="float64"):
            return self.mpi_comm.allreduce(float(value), op=MPI.MIN)

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        with in_mpi(self, "barrier"):
            self.mpi_comm.Barrier()

    # ----------------------------------------------------------------- internals

    def _all_gather_message(self, full: torch.Tensor, shard: torch.Tensor, unit: str) -> None:
        """One direct all-gather (no staging), at most ``max_elements_per_message`` per rank."""
        self.bytes_moved["all_gather"] += full.numel() * full.element_size()
        with in_mpi(self, "all_gather", shard, unit):
            wait_for_producer(shard)
            self._mpi_all_gather(full, shard)

    def _reduce_scatter_message(self, shard: torch.Tensor, full: torch.Tensor, unit: str) -> None:
        """One direct reduce-scatter (no staging), at most ``max_elements_per_message`` per rank."""
        self.bytes_moved["reduce_scatter"] += full.numel() * full.element_size()
        with in_mpi(self, "reduce_scatter", full, unit):
            wait_for_producer(full)
            self._mpi_reduce_scatter(shard, full)

    # MPI's part of each collective, on buffers it can read (host memory, or device memory if CUDA-aware);
    # the output first, as in the collectives above and in torch.

    def _mpi_all_gather(self, full: torch.Tensor, shard: torch.Tensor) -> None:
        self.mpi_comm.Allgather(as_bits(shard), as_bits(full))

    def _mpi_reduce_scatter(self, shard: torch.Tensor, full: torch.Tensor) -> None:
        self.mpi_comm.Reduce_scatter_block(as_numbers(full), as_numbers(shard), op=MPI.SUM)

    def _mpi_all_to_all(self, received: torch.Tensor, sent: torch.Tensor) -> None:
        self.mpi_comm.Alltoall(as_bits(sent), as_bits(received))

    def _mpi_all_reduce(self, tensor: torch.Tensor) -> None:
        self.mpi_comm.Allreduce(MPI.IN_PLACE, as_numbers(tensor), op=MPI.SUM)

    def _mpi_broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self.mpi_comm.Bcast(as_bits(tensor), root=root)

    def _staging_chunk_numel(self, tensor: torch.Tensor) -> int:
        """Elements per rank in one staged chunk of `tensor`, by this communicator's settings."""
        return staging_chunk_numel(tensor, self.staging_chunk_bytes, self.max_elements_per_message)


def _copy_unless_same(target: torch.Tensor, source: torch.Tensor) -> None:
    """A group of one rank's collective: `target` <- `source`, unless they are the same memory already."""
    if target.data_ptr() != source.data_ptr():
        target.copy_(source)

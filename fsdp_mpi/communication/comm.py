"""The one place that talks to MPI: every collective the sharding layer uses.

Tensors go to mpi4py detached and contiguous, without copies: a CPU tensor as
a raw buffer at its address (about 1 µs; through DLPack a torch tensor costs
about 20 µs a buffer, 10% of a 4 MiB all-gather here, and a numpy view would
pin the storage's size, which resharding frees). A device tensor goes straight
to a CUDA-aware MPI as its address (``DeviceBuffer``), once the host has waited
for the stream that produced it (an event, never the whole device); otherwise it
is staged through pinned host buffers in a pipeline of chunks (``staging.py``).
Staging can be forced for CPU tensors too, so that tests exercise that path
without a GPU.

A group of one rank makes no MPI call at all: gathering is a copy (or nothing,
when the buffers are one), reducing leaves the values as they are, and objects
and floats come back unchanged. So one rank is plain torch plus the wrapper's
bookkeeping, on the GPU with nothing staged and nothing synchronised.

Callers that hand in tensors autograd saved for backward pass ``tensor.data``
aliases: MPI writes do not bump version counters, but staging's copy-back would.

Every call is recorded in the process's collective log and watched for hangs
(``collective_log``); in verify mode the ranks first check that they are all
entering the same collective.
"""

import hashlib
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from functools import partial
from typing import Callable

import numpy
import torch
from mpi4py import MPI

from fsdp_mpi.communication.background import CommunicationThread, Started, threads_may_call_mpi_at_once
from fsdp_mpi.communication.collective_log import PROCESS_LOG, CollectiveRecord, timeout_from_environment
from fsdp_mpi.communication.gpu_support import describe_device_path, mpi_is_cuda_aware
from fsdp_mpi.communication.launcher import check_launcher_agrees
from fsdp_mpi.communication.liveness import Liveness
from fsdp_mpi.communication.node_transport import NodeTransport, open_node_transport
from fsdp_mpi.communication.settings import FORCE_STAGING, NODE_TRANSPORT, VERIFY, read_flag
from fsdp_mpi.communication.staging import StagedCollectives

# MPI counts are C ints: a larger per-rank message is split into chunks of this many elements.
MAX_ELEMENTS_PER_MESSAGE = 2**31 - 1
# Staged messages move in chunks of this many bytes per rank, so that copies and MPI overlap.
STAGING_CHUNK_BYTES = 4 * 2**20



class Route(Enum):
    """How one kind of tensor (host or device memory) travels between a communicator's ranks, chosen once
    per communicator and device type, at its first collective on that kind of tensor."""

    NODE = "node"      # every rank on this node: through memory they share (node_transport.py); MPI synchronises
    DIRECT = "direct"  # MPI reads the tensor where it is (host memory, or device memory if CUDA-aware)
    STAGED = "staged"  # through pinned host buffers, in chunks (staging.py)


# Moving data needs only the bits: every dtype travels as unsigned integers of its width.
_BIT_TYPES = {1: MPI.UINT8_T, 2: MPI.INT16_T, 4: MPI.INT32_T, 8: MPI.INT64_T}
# Arithmetic needs the real type; 16-bit floats are summed in fp32 (MPI has no bf16).
_SUM_TYPES = {torch.float32: MPI.FLOAT, torch.float64: MPI.DOUBLE}
_SUM_IN_FP32 = (torch.float16, torch.bfloat16)


class Pending:
    """A collective started without waiting; ``wait()`` completes it (once; later calls do nothing).

    Holds the buffers MPI is still reading or writing, so that a caller dropping its
    own references (a temporary send buffer, say) cannot free them under MPI.
    """

    def __init__(self, comm: "Communicator", request=None, record: CollectiveRecord | None = None, buffers=(),
                 started: Started | None = None, then: Callable[[], None] | None = None):
        self._comm, self._request, self._record, self._buffers = comm, request, record, buffers
        self._started = started  # a staged collective on the communication thread (``background.py``)
        self._then = then  # what completes it once the transfer has: a copy back into the caller's tensor

    def wait(self) -> None:
        if self._request is not None:
            with self._comm._waiting(self._record):
                self._request.Wait()
        if self._started is not None:
            self._started.wait()  # the worker's own collective is watched and timed where it runs
        if self._then is not None:
            self._then()
        self._request, self._started, self._buffers, self._then = None, None, (), None


class DeviceBuffer:
    """A device tensor's bytes as mpi4py hands them to a CUDA-aware MPI: an address and a length,
    through the CUDA array interface. Like mpi4py's buffers it does not keep the tensor alive."""

    def __init__(self, tensor: torch.Tensor):
        self.address, self.nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False), "strides": None,
                "version": 3}


def _memory(tensor: torch.Tensor):
    """`tensor`'s memory as mpi4py should see it: a buffer at its address on the CPU, a ``DeviceBuffer`` on a device.

    Neither keeps the tensor alive: the caller holds it until MPI is done (``Pending`` does).
    """
    if not tensor.is_cpu:
        return DeviceBuffer(tensor)
    return MPI.buffer.fromaddress(tensor.data_ptr(), tensor.nbytes)


def _bits(tensor: torch.Tensor) -> list:
    """An mpi4py buffer spec that moves `tensor`'s bytes unchanged (made per call: no tensor is created)."""
    if tensor.element_size() not in _BIT_TYPES:
        raise TypeError(f"cannot communicate tensors of dtype {tensor.dtype}")
    return [_memory(tensor), _BIT_TYPES[tensor.element_size()]]


def _numbers(tensor: torch.Tensor) -> list:
    """An mpi4py buffer spec for reductions over `tensor`'s values."""
    return [_memory(tensor), _SUM_TYPES[tensor.dtype]]


class CollectiveMismatchError(RuntimeError):
    """Verify mode: the ranks were about to enter different collectives."""


@dataclass
class Traffic:
    """What a rank's collectives cost it, for profiling: wall time blocked in MPI, and per operation the
    bytes of the full buffer each collective fills (all-gather) or reads (reduce-scatter, all-reduce) and
    of each broadcast tensor, in the dtype actually sent: what the wire carries, algorithms aside."""

    seconds_in_mpi: float = 0.0
    bytes_moved: Counter = field(default_factory=Counter)


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
        self._routes: dict[str, Route] = {}  # device type -> how its tensors travel (``_route``)
        self._route_reasons: dict[str, str] = {}  # device type -> why, for the run's log
        self._node: dict[str, NodeTransport] = {}  # device type -> the node transport, where it is the route
        self.traffic = Traffic()  # shared with the communicators split from this one
        self._staged = StagedCollectives()
        # Where the library lets two threads call MPI at once, staged collectives started early run there.
        self._background = CommunicationThread() if threads_may_call_mpi_at_once() else None
        if (self.mpi_comm == MPI.COMM_WORLD and self.world_size > 1 and self._background is not None
                and PROCESS_LOG.liveness is None):  # collective: every rank builds a first world Communicator
            PROCESS_LOG.start_answering(Liveness(self.mpi_comm))  # so the watchdog can ask who is still there

    def describe_route(self, device: torch.device) -> str:
        """How `device`'s tensors travel between the ranks here, and why (for a run's log). Collective: it
        chooses the route if no collective has yet."""
        if self.world_size == 1:
            return ("one rank: no tensor reaches MPI (gathering is a copy or nothing, reducing leaves gradients as "
                    "they are)")
        route, why = self._route(device), self._route_reasons[device.type]
        if route is Route.NODE:
            return f"{why} ({NODE_TRANSPORT.name}=0: through MPI instead)"
        through_mpi = (describe_device_path(self.cuda_aware, self.force_staging) if device.type == "cuda"
                       else "host buffers go to MPI")
        return f"{through_mpi}; not through shared memory: {why}"

    @property
    def routes(self) -> dict[str, str]:
        """How each kind of tensor has travelled here so far: {"cpu": "node"}, say (see ``Route``)."""
        return {kind: route.value for kind, route in self._routes.items()}

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
        self._check_pair(full, shard, "all_gather_into")
        if self.world_size == 1:
            _copy_unless_same(full, shard)
            return
        route = self._route(full.device)
        if route is Route.NODE:
            self.bytes_moved["all_gather"] += full.numel() * full.element_size()
            with self._collective("all_gather", shard, unit):
                self._node[full.device.type].all_gather(full, shard)
            return
        if route is Route.STAGED:
            self.bytes_moved["all_gather"] += full.numel() * full.element_size()
            with self._collective("all_gather", shard, unit):
                self._staged.all_gather(full, shard, self._staging_chunk_numel(shard), self._mpi_all_gather)
            return
        chunk = self.max_elements_per_message
        if shard_numel <= chunk:
            self._allgather(full, shard, unit)
            return
        full_by_rank = full.view(self.world_size, shard_numel)
        for start in range(0, shard_numel, chunk):
            stop = min(start + chunk, shard_numel)
            gathered = torch.empty(self.world_size, stop - start, dtype=full.dtype, device=full.device)
            self._allgather(gathered, shard[start:stop], unit)
            full_by_rank[:, start:stop].copy_(gathered)

    def reduce_scatter_sum(self, shard: torch.Tensor, full: torch.Tensor, unit: str = "") -> None:
        """shard (S,) <- sum over ranks of their full[rank * S:(rank + 1) * S].

        A sum, as MPI computes it: the sharding layer makes it a mean by scaling the
        gradient as backward assembles it (``flat_param``), which costs no pass of its own.
        """
        self._check_pair(full, shard, "reduce_scatter_sum")
        if self.world_size == 1:
            _copy_unless_same(shard, full)
            return
        if self._route(full.device) is Route.NODE:  # sends 16-bit values as they are, sums them in fp32
            self.bytes_moved["reduce_scatter"] += full.numel() * full.element_size()
            with self._collective("reduce_scatter", full, unit):
                self._node[full.device.type].reduce_scatter(shard, full)
            return
        if shard.dtype in _SUM_IN_FP32:
            shard_fp32 = torch.empty(shard.numel(), dtype=torch.float32, device=shard.device)
            self.reduce_scatter_sum(shard_fp32, full.float(), unit)
            shard.copy_(shard_fp32)
            return
        if self._needs_staging(full):
            self.bytes_moved["reduce_scatter"] += full.numel() * full.element_size()
            with self._collective("reduce_scatter", full, unit):
                self._staged.reduce_scatter(shard, full, self._staging_chunk_numel(shard), self._mpi_reduce_scatter)
            return
        shard_numel = shard.numel()
        chunk = self.max_elements_per_message
        if shard_numel <= chunk:
            self._reduce_scatter(shard, full, unit)
            return
        full_by_rank = full.view(self.world_size, shard_numel)
        for start in range(0, shard_numel, chunk):
            stop = min(start + chunk, shard_numel)
            self._reduce_scatter(shard[start:stop], full_by_rank[:, start:stop].contiguous(), unit)

    def all_reduce_sum_(self, tensor: torch.Tensor, unit: str = "") -> None:
        """tensor <- its element-wise sum over ranks, in place (the replicas of HYBRID_SHARD and NO_SHARD,
        metrics)."""
        if self.world_size == 1:
            return
        if not tensor.is_contiguous():
            raise ValueError("all_reduce_sum_ needs a contiguous tensor")
        if self._route(tensor.device) is Route.NODE:
            flat = tensor.view(-1)
            self.bytes_moved["all_reduce"] += flat.numel() * flat.element_size()
            with self._collective("all_reduce", flat, unit):
                self._node[flat.device.type].all_reduce(flat)
            return
        if tensor.dtype in _SUM_IN_FP32:
            tensor_fp32 = tensor.float()
            self.all_reduce_sum_(tensor_fp32, unit)
            tensor.copy_(tensor_fp32)
            return
        flat = tensor.view(-1)
        self.bytes_moved["all_reduce"] += flat.numel() * flat.element_size()
        if self._needs_staging(flat):
            with self._collective("all_reduce", flat, unit):
                self._staged.in_place(flat, self._staging_chunk_numel(flat), self._mpi_all_reduce, slot="all_reduce")
            return
        for start in range(0, flat.numel(), self.max_elements_per_message):
            part = flat[start:start + self.max_elements_per_message]
            with self._collective("all_reduce", part, unit):
                self._wait_for_producer(part)
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
        route = self._route(sent.device)
        if route is Route.NODE:
            with self._collective("all_to_all", sent, unit):
                self._node[sent.device.type].all_to_all(received, sent)
            return
        if route is Route.STAGED:
            with self._collective("all_to_all", sent, unit):
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
            with self._collective("all_to_all", send, unit):
                self._wait_for_producer(send)
                self._mpi_all_to_all(send, receive)
            if not whole:
                received_by_rank[:, start:stop].copy_(receive)

    def split(self, color: int | None) -> "Communicator":
        """A communicator over the ranks that pass the same `color` (None: the ranks of this node), in rank
        order, with this one's settings. A group of one rank is its own only split."""
        if self.world_size == 1:
            return self
        with self._collective("split"):
            if color is None:
                sub = self.mpi_comm.Split_type(MPI.COMM_TYPE_SHARED, self.rank)
            else:
                sub = self.mpi_comm.Split(color, self.rank)
        child = Communicator(sub, force_staging=self.force_staging, cuda_aware=self.cuda_aware,
                             node_transport=self.node_transport, timeout=self.timeout, verify=self.verify)
        child.traffic, child.node_exchange_bytes = self.traffic, self.node_exchange_bytes
        return child

    def start_all_gather_into(self, full: torch.Tensor, shard: torch.Tensor, unit: str = "") -> Pending:
        """Like ``all_gather_into``, returning before the data has arrived: ``wait()`` before reading `full`.

        A staged transfer, or one of device memory, runs on the communication thread
        (``background.py``). A direct (unchunked) one of host memory is a nonblocking MPI call: MPI
        moves the data when its progress engine runs, inside later MPI calls, or in the
        background where the library has a progress thread or offloads to hardware. Others
        (a node transfer of host memory: copies the CPU would make anyway) complete here.
        """
        self._check_pair(full, shard, "start_all_gather_into")
        route = self._route(full.device) if self.world_size > 1 else None
        if self._on_the_communication_thread(route, full):
            started = self._background.start(partial(self.all_gather_into, full, shard, unit), full.device)
            return Pending(self, buffers=(full, shard), started=started)
        if route is not Route.DIRECT or shard.numel() > self.max_elements_per_message:
            self.all_gather_into(full, shard, unit)
            return Pending(self)
        self.bytes_moved["all_gather"] += full.numel() * full.element_size()
        with self._collective("all_gather", shard, unit, finishes=False) as record:
            self._wait_for_producer(shard)
            request = self.mpi_comm.Iallgather(_bits(shard), _bits(full))
        return Pending(self, request, record, buffers=(full, shard))

    def start_reduce_scatter_sum(self, shard: torch.Tensor, full: torch.Tensor, unit: str = "") -> Pending:
        """Like ``reduce_scatter_sum``, returning at once: `shard` holds the sum after ``wait()``."""
        self._check_pair(full, shard, "start_reduce_scatter_sum")
        route = self._route(full.device) if self.world_size > 1 else None
        if self._on_the_communication_thread(route, full):
            if route is Route.STAGED and shard.dtype in _SUM_IN_FP32:
                return self._start_reduce_scatter_in_fp32(shard, full, unit)
            started = self._background.start(partial(self.reduce_scatter_sum, shard, full, unit), full.device)
            return Pending(self, buffers=(full, shard), started=started)
        direct = route is Route.DIRECT and shard.numel() <= self.max_elements_per_message
        if not direct or shard.dtype in _SUM_IN_FP32 or (full.is_cuda and not self.device_reductions_in_background):
            self.reduce_scatter_sum(shard, full, unit)
            return Pending(self)
        self.bytes_moved["reduce_scatter"] += full.numel() * full.element_size()
        with self._collective("reduce_scatter", full, unit, finishes=False) as record:
            self._wait_for_producer(full)
            request = self.mpi_comm.Ireduce_scatter_block(_numbers(full), _numbers(shard), op=MPI.SUM)
        return Pending(self, request, record, buffers=(full, shard))

    def _start_reduce_scatter_in_fp32(self, shard: torch.Tensor, full: torch.Tensor, unit: str) -> Pending:
        """A 16-bit reduce-scatter for the worker, summed in fp32 as every 16-bit sum through MPI is. The fp32
        copies are made here, on the caller's stream: made by the worker, on its side stream, they would come
        from that stream's share of the caching allocator, which the compute stream cannot reuse (a
        gradient-sized block held apart per unit). ``wait()`` rounds the sum into `shard`."""
        full_fp32 = full.float()  # (world_size * shard_numel,)
        shard_fp32 = torch.empty(shard.numel(), dtype=torch.float32, device=shard.device)
        started = self._background.start(partial(self.reduce_scatter_sum, shard_fp32, full_fp32, unit), full.device)
        return Pending(self, buffers=(full_fp32, shard_fp32), started=started, then=lambda: shard.copy_(shard_fp32))

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> None:
        """Overwrites `tensor` on every rank with root's."""
        if not tensor.is_contiguous():
            raise ValueError("broadcast_ needs a contiguous tensor")
        if self.world_size == 1:
            return
        flat = tensor.view(-1)
        self.bytes_moved["broadcast"] += flat.numel() * flat.element_size()
        broadcast = partial(self._mpi_broadcast, root=root)
        route = self._route(flat.device)
        if route is Route.NODE:
            with self._collective("broadcast", flat):
                self._node[flat.device.type].broadcast(flat, root)
            return
        if route is Route.STAGED:
            with self._collective("broadcast", flat):
                self._staged.in_place(flat, self._staging_chunk_numel(flat), broadcast, send=self.rank == root,
                                      receive=self.rank != root, slot="broadcast")
            return
        for start in range(0, max(flat.numel(), 1), self.max_elements_per_message):
            part = flat[start:start + self.max_elements_per_message]
            with self._collective("broadcast", part):
                self._wait_for_producer(part)
                broadcast(part)

    def all_gather_object(self, obj) -> list:
        """Every rank's small picklable `obj`, in rank order (for checks, not tensors)."""
        if self.world_size == 1:
            return [obj]
        with self._collective("all_gather_object"):
            return self.mpi_comm.allgather(obj)

    def broadcast_object(self, obj, root: int = 0):
        """Root's small picklable `obj` on every rank (settings, error messages, a port number)."""
        if self.world_size == 1:
            return obj
        with self._collective("broadcast_object"):
            return self.mpi_comm.bcast(obj, root=root)

    def all_reduce_sum_float(self, value: float) -> float:
        """Sum of a Python float over ranks (losses, counters)."""
        if self.world_size == 1:
            return float(value)
        with self._collective("all_reduce_sum", numel=1, dtype="float64"):
            return self.mpi_comm.allreduce(float(value), op=MPI.SUM)

    def all_reduce_max_float(self, value: float) -> float:
        """Maximum of a Python float over ranks."""
        if self.world_size == 1:
            return float(value)
        with self._collective("all_reduce_max", numel=1, dtype="float64"):
            return self.mpi_comm.allreduce(float(value), op=MPI.MAX)

    def all_reduce_min_float(self, value: float) -> float:
        """Minimum of a Python float over ranks."""
        if self.world_size == 1:
            return float(value)
        with self._collective("all_reduce_min", numel=1, dtype="float64"):
            return self.mpi_comm.allreduce(float(value), op=MPI.MIN)

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        with self._collective("barrier"):
            self.mpi_comm.Barrier()

    # ----------------------------------------------------------------- internals

    def _allgather(self, recv: torch.Tensor, send: torch.Tensor, unit: str) -> None:
        """One direct all-gather (no staging), at most ``max_elements_per_message`` per rank."""
        self.bytes_moved["all_gather"] += recv.numel() * recv.element_size()
        with self._collective("all_gather", send, unit):
            self._wait_for_producer(send)
            self._mpi_all_gather(send, recv)

    def _reduce_scatter(self, recv: torch.Tensor, send: torch.Tensor, unit: str) -> None:
        """One direct reduce-scatter (no staging), at most ``max_elements_per_message`` per rank."""
        self.bytes_moved["reduce_scatter"] += send.numel() * send.element_size()
        with self._collective("reduce_scatter", send, unit):
            self._wait_for_producer(send)
            self._mpi_reduce_scatter(send, recv)

    # MPI's part of each collective, on buffers it can read (host memory, or device memory if CUDA-aware).

    def _mpi_all_gather(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        self.mpi_comm.Allgather(_bits(send), _bits(recv))

    def _mpi_reduce_scatter(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        self.mpi_comm.Reduce_scatter_block(_numbers(send), _numbers(recv), op=MPI.SUM)

    def _mpi_all_to_all(self, send: torch.Tensor, recv: torch.Tensor) -> None:
        self.mpi_comm.Alltoall(_bits(send), _bits(recv))

    def _mpi_all_reduce(self, tensor: torch.Tensor) -> None:
        self.mpi_comm.Allreduce(MPI.IN_PLACE, _numbers(tensor), op=MPI.SUM)

    def _mpi_broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self.mpi_comm.Bcast(_bits(tensor), root=root)

    def _route(self, device: torch.device) -> Route:
        """How tensors on `device` travel here: chosen at the first collective on such a tensor, then kept."""
        route = self._routes.get(device.type)
        return route if route is not None else self._choose_route(device)

    def _choose_route(self, device: torch.device) -> Route:
        """Opens the node transport where it can (collective: every rank is in the same first collective on
        this kind of tensor), else MPI's route: direct, or staged where MPI cannot read the memory."""
        kind = device.type
        if self.world_size > 1 and self.node_transport and kind in ("cpu", "cuda"):
            with self._collective("open_node_transport"):
                transport, why = open_node_transport(self.mpi_comm, device, self.node_exchange_bytes)
            if transport is not None:
                self._node[kind] = transport
                self._routes[kind], self._route_reasons[kind] = Route.NODE, why
                return Route.NODE
        elif self.force_staging:
            why = f"{FORCE_STAGING.name}=1"
        elif not self.node_transport:
            why = f"{NODE_TRANSPORT.name}=0"
        else:
            why = "one rank" if self.world_size == 1 else f"no shared memory for {kind} tensors"
        staged = self.force_staging or (kind != "cpu" and not self.cuda_aware)
        self._routes[kind], self._route_reasons[kind] = (Route.STAGED if staged else Route.DIRECT), why
        return self._routes[kind]

    def _on_the_communication_thread(self, route: Route | None, tensor: torch.Tensor) -> bool:
        """Whether a started collective runs on the worker: host work that would otherwise hold the main thread.
        That is staging; queueing a node transfer's device copies behind a barrier; and handing device memory
        to a CUDA-aware MPI, before which the host waits for the stream that produced it: on the worker, the
        main thread goes on queueing the next units' kernels meanwhile."""
        return self._background is not None and (
            route is Route.STAGED or (tensor.is_cuda and route in (Route.NODE, Route.DIRECT)))

    def _needs_staging(self, tensor: torch.Tensor) -> bool:
        return self._route(tensor.device) is Route.STAGED

    def _staging_chunk_numel(self, tensor: torch.Tensor) -> int:
        """Elements per rank in one staged chunk: ``staging_chunk_bytes``, within MPI's count limit."""
        return max(1, min(self.staging_chunk_bytes // tensor.element_size(), self.max_elements_per_message))

    @staticmethod
    def _wait_for_producer(tensor: torch.Tensor) -> None:
        """Before a CUDA-aware MPI reads or writes device memory: the host waits until the stream that
        produced `tensor` has got this far (an event on that stream, not the whole device)."""
        if tensor.is_cuda:
            produced = torch.cuda.Event()
            produced.record(torch.cuda.current_stream(tensor.device))
            produced.synchronize()

    def _collective(self, operation: str, sent: torch.Tensor | None = None, unit: str = "", *, numel: int = 0,
                    dtype: str = "", finishes: bool = True) -> "_InMPI":
        """Every MPI call runs inside this: logged, checked across ranks in verify mode, watched and timed.

        `sent` is the tensor this rank contributes (its size and dtype are logged).
        A nonblocking call passes ``finishes=False``: its ``Pending.wait()`` completes the record.
        """
        if self._background is not None:  # what was handed to the communication thread goes first
            self._background.wait_for_all()
        if sent is not None:
            numel, dtype = sent.numel(), _dtype_name(sent.dtype)
        record = PROCESS_LOG.begin(self.collectives_started, operation, unit, numel, dtype)
        self.collectives_started += 1
        return _InMPI(self, record, finishes)

    @contextmanager
    def _waiting(self, record: CollectiveRecord):
        """Completing a nonblocking collective: watched and timed like a blocking one."""
        with PROCESS_LOG.blocking(record, self.timeout, self.rank):
            start = time.perf_counter()
            try:
                yield
            finally:
                self.traffic.seconds_in_mpi += time.perf_counter() - start

    def _verify_every_rank_enters(self, record: CollectiveRecord) -> None:
        """Raises CollectiveMismatchError on every rank (rank 0 says which ranks entered what)
        unless all ranks are entering the same collective.

        Every rank calls this before every collective, so its own two calls always
        match each other in MPI whatever the ranks were about to do.
        """
        digest = int.from_bytes(hashlib.blake2b(record.fingerprint().encode(), digest_size=7).digest(), "little")
        extremes = numpy.array([digest, -digest], dtype=numpy.int64)  # max and -min of the digests over ranks
        self.mpi_comm.Allreduce(MPI.IN_PLACE, [extremes, MPI.INT64_T], op=MPI.MAX)  # numpy: 10x less overhead
        if extremes[0] == -extremes[1]:
            return
        entering = self.mpi_comm.allgather(record.describe())
        ranks_by_collective: dict[str, list[int]] = {}
        for rank, description in enumerate(entering):
            ranks_by_collective.setdefault(description, []).append(rank)
        lines = [f"  rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {description}"
                 for description, ranks in ranks_by_collective.items()]
        if self.rank != 0:  # every rank stops; one of them explains
            raise CollectiveMismatchError(f"ranks are entering different collectives ({VERIFY.name}): see rank 0")
        raise CollectiveMismatchError(
            f"ranks are entering different collectives ({VERIFY.name}):\n" + "\n".join(lines) + "\n"
            "Every rank must run the same units in the same order with the same shapes: look for control flow "
            "that depends on the rank or its data, a unit skipped on some ranks, or different model code.\n"
            f"Last collectives on rank {self.rank}, oldest first:\n{PROCESS_LOG.recent()}")

    def _check_pair(self, full: torch.Tensor, shard: torch.Tensor, what: str) -> None:
        if full.numel() != shard.numel() * self.world_size:
            raise ValueError(
                f"{what}: full buffer has {full.numel()} elements, expected "
                f"{self.world_size} x {shard.numel()}"
            )
        if full.dtype != shard.dtype or not (full.is_contiguous() and shard.is_contiguous()):
            raise ValueError(f"{what}: buffers must be contiguous and of one dtype")


class _InMPI:
    """The bookkeeping around one MPI call, as ``with comm._collective(...) as record``: the rank is marked
    as waiting in `record` (watched for hangs), verify mode checks the ranks agree, and the time is counted.
    A class rather than a generator-based context manager: every collective pays for it (0.6 µs less)."""

    __slots__ = ("comm", "record", "finishes", "start")

    def __init__(self, comm: Communicator, record: CollectiveRecord, finishes: bool):
        self.comm, self.record, self.finishes = comm, record, finishes

    def __enter__(self) -> CollectiveRecord:
        comm = self.comm
        PROCESS_LOG.enter(self.record, comm.timeout, comm.rank)
        self.start = time.perf_counter()
        if comm.verify:
            try:
                comm._verify_every_rank_enters(self.record)
            except BaseException:
                self.__exit__()
                raise
        return self.record

    def __exit__(self, *exception) -> None:
        self.comm.traffic.seconds_in_mpi += time.perf_counter() - self.start
        PROCESS_LOG.leave(self.record, self.finishes)


_DTYPE_NAMES: dict[torch.dtype, str] = {}


def _dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32, for the collective log (looked up: formatting it is slower than the lookup)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


def _copy_unless_same(target: torch.Tensor, source: torch.Tensor) -> None:
    """A group of one rank's collective: `target` <- `source`, unless they are the same memory already."""
    if target.data_ptr() != source.data_ptr():
        target.copy_(source)

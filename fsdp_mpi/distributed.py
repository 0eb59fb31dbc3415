"""torch.distributed over fsdp_mpi: a process-group backend named ``"fsdp_mpi"``, so that torch's own FSDP2
(``fully_shard``), DDP, DTensor and Lightning's strategies run on mpi4py and fsdp_mpi's transports.

    import fsdp_mpi.distributed                  # registers the backend
    fsdp_mpi.distributed.init_process_group()    # under mpiexec or srun: rank and world size from MPI

or ``torch.distributed.init_process_group("fsdp_mpi")`` where the usual variables are set. Every collective
goes through a ``Communicator`` (the node transport, two levels across nodes, staging, the watchdog and the
collective log, as for ``FullyShardedDataParallel``); a group made by ``new_group`` or a device mesh is an MPI
communicator of its ranks. A collective runs when it is called, or, where it is host work that would hold
the caller (staging, device memory), on the communicator's communication thread; either way the returned
``Work`` completes through a future (on a GPU, one that orders the caller's stream after the collective).

torch calls a Python process group through the methods below (their names as torch 2.13 calls them, and the
older ones, which torch before 2.13 calls, beside them). What MPI or the transports cannot do (reductions
other than sums, maxima, minima and products; all-to-all with uneven splits; receiving from any source)
raises ``NotImplementedError`` naming the call.
"""

from datetime import timedelta

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

from fsdp_mpi.communication.comm import Communicator

BACKEND = "fsdp_mpi"
_OP = dist.ReduceOp.RedOpType
_COMBINED = {_OP.MAX: lambda by_rank: by_rank.amax(0), _OP.MIN: lambda by_rank: by_rank.amin(0),
             _OP.PRODUCT: lambda by_rank: by_rank.prod(0)}  # taken locally from every rank's values


class MpiProcessGroup(dist.ProcessGroup):
    """A torch process group whose collectives are a ``Communicator``'s."""

    def __init__(self, comm: Communicator):
        super().__init__(comm.rank, comm.world_size)
        self.comm, self._group_name, self._group_desc = comm, "", ""

    def getBackendName(self) -> str:
        return BACKEND

    @property
    def name(self) -> str:
        return BACKEND

    # A Python process group keeps its own name: torch looks it up through backends that it has none of.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:
        return self._group_name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:
        return self._group_desc

    # A group bound to a device (init_process_group's device_id, which Lightning passes on a GPU) is asked for its
    # backend there, to connect or split it ahead: this group is its own backend on every device, and does neither.
    supports_splitting = supports_coalescing = supports_time_estimate = False

    def _get_backend(self, device: torch.device) -> "MpiProcessGroup":
        return self

    # ----------------------------------------------------------------- reductions

    def allreduce(self, tensors, opts=None):
        op = _Reduction.of(opts, "all_reduce", sums_only=False)
        return self._run(lambda: [self._all_reduce(tensor, op) for tensor in tensors], tensors, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        op = _Reduction.of(opts, "reduce_scatter")
        return self._run(lambda: self._reduce_scatter(output, input, op), output, [output])

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        op = _Reduction.of(opts, "reduce_scatter")
        return self._run(lambda: [self._reduce_scatter(o, i, op) for o, i in zip(outputs, inputs)], outputs,
                         outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        op = _Reduction.of(opts, "reduce_scatter")
        return self._run(lambda: [self._reduce_scatter(o, torch.cat([t.reshape(-1) for t in parts]), op)
                                  for o, parts in zip(outputs, input_lists)], outputs, outputs)

    def reduce(self, tensors, opts=None):
        op = _Reduction.of(opts, "reduce", sums_only=False)
        return self._run(lambda: [self._all_reduce(tensor, op) for tensor in tensors], tensors, tensors)

    # ----------------------------------------------------------------- moving

    def all_gather_single(self, output, input, opts=None):
        return self._run(lambda: self._all_gather(output, input), output, [output])

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        return self._run(lambda: [self._all_gather(o, i) for o, i in zip(outputs, inputs)], outputs, outputs)

    def allgather(self, output_lists, inputs, opts=None):
        def gather():
            for outputs, tensor in zip(output_lists, inputs):
                full = torch.empty(self.comm.world_size * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
                self._all_gather(full, tensor)
                for out, part in zip(outputs, full.view(self.comm.world_size, -1)):
                    out.copy_(part.view_as(out))
        return self._run(gather, inputs, output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists, inputs, opts)

    def gather(self, output_lists, inputs, opts=None):
        return self.allgather(output_lists if output_lists and output_lists[0] else
                              [[torch.empty_like(t) for _ in range(self.comm.world_size)] for t in inputs], inputs)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0
        return self._run(lambda: [self._broadcast(tensor, root) for tensor in tensors], tensors, tensors)

    def scatter(self, outputs, input_lists, opts=None):
        root = opts.rootRank if opts is not None else 0

        def scatter():
            for out in outputs:
                whole = (torch.cat([t.reshape(-1) for t in input_lists[0]]) if self.comm.rank == root else
                         torch.empty(self.comm.world_size * out.numel(), dtype=out.dtype, device=out.device))
                self._broadcast(whole, root)
                out.copy_(whole.view(self.comm.world_size, -1)[self.comm.rank].view_as(out))
        return self._run(scatter, outputs, outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if output_split_sizes or input_split_sizes:
            even = [output.shape[0] // self.comm.world_size] * self.comm.world_size
            if list(output_split_sizes or even) != even or list(input_split_sizes or even) != even:
                raise NotImplementedError(f"{BACKEND}: all_to_all_single with uneven splits ({input_split_sizes} "
                                          f"sent, {output_split_sizes} received): only even splits are supported")
        return self._run(lambda: self._all_to_all(output, input), output, [output])

    def alltoall(self, outputs, inputs, opts=None):
        def exchange():
            sent = torch.cat([t.reshape(-1) for t in inputs])
            received = torch.empty_like(sent)
            self._all_to_all(received, sent)
            for out, part in zip(outputs, received.view(self.comm.world_size, -1)):
                out.copy_(part.view_as(out))
        return self._run(exchange, inputs, outputs)

    def barrier(self, opts=None):
        return self._run(self.comm.barrier, None, None)

    def send(self, tensors, destination, tag):
        return self._run(lambda: [self.comm.mpi_comm.Send(_host(t).numpy(), dest=destination, tag=tag)
                                  for t in tensors], None, tensors)

    def recv(self, tensors, source, tag):
        def receive():
            for tensor in tensors:
                host = torch.empty(tensor.shape, dtype=tensor.dtype)
                self.comm.mpi_comm.Recv(host.numpy(), source=source, tag=tag)
                tensor.copy_(host)
        return self._run(receive, None, tensors)

    def recv_anysource(self, tensors, tag):
        raise NotImplementedError(f"{BACKEND}: recv from any source is not supported; name the source rank")

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        raise NotImplementedError(f"{BACKEND}: monitored_barrier is gloo's; fsdp_mpi's watchdog "
                                  f"(FSDP_MPI_TIMEOUT) reports a rank that does not arrive")

    # the names torch before 2.13 calls
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single

    # ----------------------------------------------------------------- through the communicator

    def _run(self, collective, on, result) -> dist.Work:
        """Runs `collective` now, or on the communication thread where the communicator's transport for `on`'s
        memory runs started collectives there; the returned work's future has `result`."""
        first = on[0] if isinstance(on, (list, tuple)) and on and isinstance(on[0], torch.Tensor) else on
        device = first.device if isinstance(first, torch.Tensor) else torch.device("cpu")
        future = Future(devices=[device]) if device.type == "cuda" else Future()

        def run_and_complete():
            collective()
            future.set_result(result)
        thread = self.comm.communication_thread
        if thread is not None and first is not None and self.comm.transport(device).makes_mpi_calls \
                and self.comm.transport(device).runs_started_on_the_worker(first):
            thread.start(run_and_complete, device)
        else:
            run_and_complete()
        return _create_work_from_future(future)

    def _all_reduce(self, tensor: torch.Tensor, op: "_Reduction") -> None:
        flat = _contiguous(tensor)
        if op.kind in _COMBINED:
            gathered = torch.empty(self.comm.world_size * flat.numel(), dtype=flat.dtype, device=flat.device)
            self.comm.all_gather_into(gathered, flat.view(-1))
            flat.copy_(_COMBINED[op.kind](gathered.view(self.comm.world_size, *flat.shape)))
        else:
            op.before(flat)
            self.comm.all_reduce_sum_(flat)
            op.after(flat, self.comm.world_size)
        if flat is not tensor:
            tensor.copy_(flat)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, op: "_Reduction") -> None:
        shard = _contiguous(output)
        full = _contiguous(input)
        if op.factor is not None:
            full = full * op.factor  # a copy: the caller's input stays as it was
        self.comm.reduce_scatter_sum(shard.view(-1), full.view(-1))
        op.after(shard, self.comm.world_size)
        if shard is not output:
            output.copy_(shard)

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        full = _contiguous(output)
        self.comm.all_gather_into(full.view(-1), _contiguous(input).view(-1))
        if full is not output:
            output.copy_(full)

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> None:
        received = _contiguous(output)
        self.comm.all_to_all(received.view(-1), _contiguous(input).view(-1))
        if received is not output:
            output.copy_(received)

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        flat = _contiguous(tensor)
        self.comm.broadcast_(flat, root)
        if flat is not tensor:
            tensor.copy_(flat)


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.is_contiguous() else tensor.contiguous()


def _host(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().contiguous()


class _Reduction:
    """What a collective's reduce op asks for: a sum (SUM; AVG, the sum divided by the ranks; PREMUL_SUM, each
    rank's values times a factor, then summed), or, for an all-reduce, MAX, MIN or PRODUCT (``_COMBINED``)."""

    def __init__(self, kind, factor: float | None):
        self.kind, self.factor = kind, factor

    @classmethod
    def of(cls, opts, call: str, sums_only: bool = True) -> "_Reduction":
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        kind = getattr(op, "op", op)  # a ReduceOp object carries its RedOpType
        if kind in (_OP.SUM, _OP.AVG) or (kind in _COMBINED and not sums_only):
            return cls(kind, None)
        if kind == _OP.PREMUL_SUM:
            return cls(kind, float(op.factor))
        allowed = "SUM, AVG and PREMUL_SUM" + ("" if sums_only else ", MAX, MIN and PRODUCT")
        raise NotImplementedError(f"{BACKEND}: {call} with {kind}: {allowed} are supported")

    def before(self, tensor: torch.Tensor) -> None:
        if self.factor is not None:
            tensor.mul_(self.factor)

    def after(self, tensor: torch.Tensor, ranks: int) -> None:
        if self.kind == _OP.AVG:
            tensor.div_(ranks)


def _create(options, backend_options=None) -> MpiProcessGroup:
    """torch's creator of a group (``register_backend(extended_api=True)``): the world for the default group,
    else an MPI communicator of the group's ranks, made by those ranks alone."""
    ranks = list(options.global_ranks_in_group) or list(range(MPI.COMM_WORLD.Get_size()))
    if len(ranks) == MPI.COMM_WORLD.Get_size() and ranks == sorted(ranks):
        comm = Communicator(MPI.COMM_WORLD)
    else:
        group = MPI.COMM_WORLD.Get_group().Incl(ranks)
        comm = Communicator(MPI.COMM_WORLD.Create_group(group, tag=_tag(ranks)))
        group.Free()
    if comm.rank != options.group_rank or comm.world_size != options.group_size:
        raise RuntimeError(f"{BACKEND}: torch.distributed's rank {options.group_rank} of {options.group_size} is "
                           f"MPI's rank {comm.rank} of {comm.world_size}: start every rank under mpiexec or srun, "
                           f"with RANK and WORLD_SIZE (if set) as MPI numbers them")
    return MpiProcessGroup(comm)


def _tag(ranks: list[int]) -> int:
    """A tag for MPI_Comm_create_group that differs between groups made at once by different ranks."""
    return sum(rank * 31 ** index for index, rank in enumerate(ranks)) % 32767


def init_process_group(timeout: timedelta | None = None, **kwargs) -> None:
    """``torch.distributed.init_process_group`` on this backend, with rank and world size from MPI (started by
    ``mpiexec`` or ``srun``): no ``MASTER_ADDR`` or store to give."""
    world = MPI.COMM_WORLD
    store = dist.HashStore()  # torch's default group needs a store; the collectives never use it
    dist.init_process_group(BACKEND, store=store, rank=world.Get_rank(), world_size=world.Get_size(),
                            **({"timeout": timeout} if timeout is not None else {}), **kwargs)


dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])

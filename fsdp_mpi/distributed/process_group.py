"""``MpiProcessGroup``: a torch process group whose every call is a ``Communicator``'s.

Each call torch makes maps onto the communicator's collectives (the node transport, two levels across nodes,
staging, the watchdog and the collective log, as for ``FullyShardedDataParallel``) or its messages between two
ranks, and adds no transport of its own:

    all-gather, reduce-scatter, all-reduce, broadcast, all-to-all     the communicator's, one call each; the
                                                                       coalesced forms in one call too
    lists of tensors (all_gather, scatter, all_to_all of a list)      through one flat buffer; an all-to-all of
                                                                       uneven parts pads them to the largest
    MAX, MIN, PRODUCT and the bitwise ops (``reductions.py``)          every rank's values brought together
                                                                       (all-gather, or all-to-all for a
                                                                       reduce-scatter), then combined
    send, recv (from a rank or from any), isend, irecv                 the communicator's messages: nonblocking

Every call completes on the communicator's communication thread, in the order the group made them: a collective
runs there, a message is started at once and finished there when waited for. Its ``MpiWork`` completes with its
result or its error, and ``wait()`` raises at the group's timeout (``work.py``). A collective's input tensors are
kept until it has read them: on the communication thread's stream, through the caching allocator
(``record_stream``), as NCCL's backend does. Where MPI does not let a second thread call it, calls run where
they are made and the watchdog ends the job at the timeout.

torch calls a Python process group through the methods below (their names as torch 2.13 calls them, and the
older ones beside them).
"""

import torch
import torch.distributed as dist
from mpi4py import MPI

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.settings import TIMEOUT, read_seconds, read_text
from fsdp_mpi.communication.machinery.worker import threads_may_call_mpi_at_once
import fsdp_mpi.distributed.composed as composed  # the module: the package imports this one
from fsdp_mpi.distributed.reductions import Reduction
from fsdp_mpi.distributed.work import GroupFailed, MpiWork

BACKEND = "fsdp_mpi"
DEVICE_TYPES = ("cpu", "cuda")  # where the backend's calls run: the tensors' own memory, or staged through the host


class MpiProcessGroup(dist.ProcessGroup):
    """A torch process group whose collectives and messages are `comm`'s (an MPI communicator of its own), each
    waited for at most `limit` seconds (0, as given a communicator alone: without end, the communicator's watchdog
    watching)."""

    def __init__(self, comm: Communicator, store=None, limit: float = 0.0):
        super().__init__(comm.rank, comm.world_size)
        self.comm, self._store, self._group_name, self._group_desc = comm, store, "", ""
        self.limit, self.failed = limit, GroupFailed()

    @classmethod
    def over(cls, mpi_comm, timeout: float, store=None) -> "MpiProcessGroup":
        """The group of `mpi_comm`'s ranks with torch's `timeout` (seconds, ``call_limit``). Where MPI lets a
        communication thread call it, each call completes there and ``wait()`` raises at the limit; the watchdog
        is then off for the group. Elsewhere calls run where they are made, and the watchdog ends the job at the
        limit, as NCCL's default error handling does."""
        limit = call_limit(timeout)
        comm = Communicator(mpi_comm, timeout=0 if threads_may_call_mpi_at_once() else limit)
        return cls(comm, store, limit)

    def getBackendName(self) -> str:
        return BACKEND

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

    # ----------------------------------------------------------------- the group, on every device

    # A group bound to a device (init_process_group's device_id, which Lightning passes on a GPU) is asked for its
    # backend there, and a device mesh splits it: this group is its own backend on every device, and splits
    # through MPI (``split_group``).
    supports_splitting = True
    supports_coalescing = supports_time_estimate = False
    options = None  # torch copies a parent's options into the groups split from it: there are none

    def _get_backend(self, device: torch.device) -> "MpiProcessGroup":
        return self

    @property
    def _device_types(self) -> list[torch.device]:
        """The device types this group has a backend for (itself, on each), as torch's helpers ask a group: the
        device of object collectives and broadcasts (``_get_pg_default_device``, a full state dict set with
        ``broadcast_from_rank0``), the CPU backend that ``dcp.async_save`` requires. A C++ group lists those
        registered with it; a Python one has none registered, and was taken for a group with no backend."""
        return [torch.device(kind) for kind in DEVICE_TYPES]

    def get_group_store(self):
        return self._store

    def _set_sequence_number_for_group(self) -> None:
        """torch asks a split group's backend to number its collectives: the communicator numbers its own."""

    def eager_connect_single_device(self, device) -> None:
        """What torch asks of a new group bound to a device that can split (NCCL connects it ahead): an MPI
        communicator is connected when it is made."""

    def perform_nocolor_split(self, device) -> None:
        """What torch asks of a rank outside a new group, where a backend's groups are split from its parent's
        (NCCL's): here a new group is made by its own ranks alone (``groups.create_group``)."""

    def split_group(self, ranks, timeout=None, opts=None, group_name=None, group_desc=None, device_types=None):
        """The group of `ranks` (of this group's numbering), or None for a rank outside it. Every rank of this group
        calls it, each naming the ranks of its own new group (disjoint groups): MPI's split, colored by a group's
        lowest rank."""
        ranks = sorted(ranks)
        comm = self.comm.split(ranks[0] if self.comm.rank in ranks else MPI.UNDEFINED)
        if comm is None:
            return None
        group = MpiProcessGroup(comm, self._store,
                                self.limit if timeout is None else call_limit(timeout.total_seconds()))
        group._set_group_name(group_name or "")
        group._set_group_desc(group_desc or "")
        return group

    # ----------------------------------------------------------------- reductions

    def allreduce(self, tensors, opts=None):
        def all_reduce():
            for tensor in tensors:
                op = Reduction.of(opts, "all_reduce", tensor.dtype)
                if tensor.is_sparse:
                    composed.sparse_sum(self.comm, tensor, op)
                else:
                    composed.all_reduce(self.comm, tensor, op)
        return self._run(all_reduce, "all_reduce", tensors, tensors)

    def allreduce_coalesced(self, tensors, opts=None):
        return self.allreduce(tensors, opts)

    def reduce(self, tensors, opts=None):
        """The all-reduce: the root gets its result, the others too (torch leaves theirs unspecified)."""
        return self.allreduce(tensors, opts)

    def reduce_scatter_single(self, output, input, opts=None):
        return self.reduce_scatter_single_coalesced([output], [input], opts)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        """outputs[i] (n_i) <- the reduction over ranks of their inputs[i][rank * n_i:(rank + 1) * n_i]: one
        collective for all of them (per dtype)."""
        def reduce_scatter():
            for dtype in dict.fromkeys(output.dtype for output in outputs):
                pairs = [(o, i) for o, i in zip(outputs, inputs) if o.dtype == dtype]
                op = Reduction.of(opts, "reduce_scatter", dtype)
                rows = torch.cat([i.reshape(self.comm.world_size, -1) for _, i in pairs], dim=1)
                shard = torch.empty(rows.shape[1], dtype=dtype, device=rows.device)
                composed.reduce_scatter(self.comm, shard, rows, op)
                for (output, _), part in zip(pairs, shard.split([o.numel() for o, _ in pairs])):
                    output.copy_(part.view_as(output))
        return self._run(reduce_scatter, "reduce_scatter", inputs, outputs)

    def reduce_scatter(self, outputs, input_lists, opts=None):
        return self.reduce_scatter_single_coalesced(
            outputs, [torch.cat([t.reshape(-1) for t in parts]) for parts in input_lists], opts)

    # ----------------------------------------------------------------- moving

    def all_gather_single(self, output, input, opts=None):
        return self.all_gather_single_coalesced([output], [input], opts)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        """outputs[i] (ranks * n_i) <- every rank's inputs[i] (n_i), in rank order: one collective for all."""
        def gather():
            for output, by_rank in zip(outputs, composed.gathered_bytes(self.comm, inputs)):
                composed.write_bytes(output, by_rank)
        return self._run(gather, "all_gather", inputs, outputs)

    def allgather(self, output_lists, inputs, opts=None):
        """output_lists[i][rank] <- rank's inputs[i]."""
        return self._all_gather_lists(lambda i, rank: output_lists[i][rank], inputs, output_lists)

    def allgather_coalesced(self, output_lists, inputs, opts=None):
        """output_lists[rank][i] <- rank's inputs[i]."""
        return self._all_gather_lists(lambda i, rank: output_lists[rank][i], inputs, output_lists)

    def gather(self, output_lists, inputs, opts=None):
        """The all-gather, into temporaries on the ranks that receive nothing."""
        if not (output_lists and output_lists[0]):
            output_lists = [[torch.empty_like(t) for _ in range(self.comm.world_size)] for t in inputs]
        return self.allgather(output_lists, inputs)

    def _all_gather_lists(self, output_of, inputs, result):
        def gather():
            for i, by_rank in enumerate(composed.gathered_bytes(self.comm, inputs)):
                for rank, part in enumerate(by_rank):
                    composed.write_bytes(output_of(i, rank), part)
        return self._run(gather, "all_gather", inputs, result)

    def broadcast(self, tensors, opts=None):
        root = opts.rootRank if opts is not None else 0

        def broadcast():
            for tensor in tensors:
                composed.broadcast(self.comm, tensor, root)
        return self._run(broadcast, "broadcast", tensors, tensors)

    def scatter(self, outputs, input_lists, opts=None):
        """outputs[0] <- root's input_lists[0][rank]: root's whole list broadcast, each rank keeping its part."""
        root = opts.rootRank if opts is not None else 0

        def scatter():
            for out in outputs:
                whole = (torch.cat([t.reshape(-1) for t in input_lists[0]]) if self.comm.rank == root else
                         torch.empty(self.comm.world_size * out.numel(), dtype=out.dtype, device=out.device))
                composed.broadcast(self.comm, whole, root)
                out.copy_(whole.view(self.comm.world_size, out.numel())[self.comm.rank].view_as(out))
        return self._run(scatter, "scatter", outputs, outputs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        """output <- rank j's part for this rank, in rank order; parts along dim 0, even or as the splits say."""
        if not output_split_sizes and not input_split_sizes:
            return self._run(lambda: composed.all_to_all(self.comm, output, input), "all_to_all", [input], [output])
        sent = composed.parts(input, input_split_sizes, self.comm.world_size)
        received = composed.parts(output, output_split_sizes, self.comm.world_size)
        return self._run(lambda: composed.all_to_all_parts(self.comm, received, sent), "all_to_all", [input], [output])

    def alltoall(self, outputs, inputs, opts=None):
        """outputs[j] <- rank j's inputs[this rank]: parts of any sizes."""
        return self._run(lambda: composed.all_to_all_parts(self.comm, outputs, inputs), "all_to_all", inputs, outputs)

    def barrier(self, opts=None):
        return self._run(self.comm.barrier, "barrier", [], None)

    # ----------------------------------------------------------------- messages between two ranks

    def send(self, tensors, dst, tag):
        return self._messages([self.comm.start_send(tensor, dst, tag) for tensor in tensors], tensors,
                              f"send to rank {dst}")

    def recv(self, tensors, src, tag):
        return self._messages([self.comm.start_receive(tensor, src, tag) for tensor in tensors], tensors,
                              f"receive from rank {src}")

    def recv_anysource(self, tensors, tag):
        return self._messages([self.comm.start_receive(tensor, None, tag) for tensor in tensors], tensors,
                              "receive from any rank")

    def _messages(self, flights: list, tensors, name: str) -> MpiWork:
        """The work of started messages: waiting finishes them, on the communication thread; a receive's source
        rank is the last one's."""
        self.failed.check()
        device = _device_of(tensors)

        def finish():
            return [flight.wait() for flight in flights][-1]
        return MpiWork(device, tensors, self._named(name), self.limit, self.failed, finish=finish,
                       start=lambda call: self._on_the_thread(call, device))

    def monitored_barrier(self, timeout=None, wait_all_ranks=False):
        raise NotImplementedError(f"{BACKEND}: monitored_barrier is gloo's; fsdp_mpi's watchdog "
                                  f"(FSDP_MPI_TIMEOUT, or the group's timeout=) names a rank that does not arrive")

    # the names torch before 2.13 calls
    _allgather_base = all_gather_single
    allgather_into_tensor_coalesced = all_gather_single_coalesced
    _reduce_scatter_base = reduce_scatter_single
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced
    alltoall_base = all_to_all_single

    # ----------------------------------------------------------------- through the communicator

    def _run(self, collective, name: str, inputs: list, result) -> MpiWork:
        """`collective` on the communication thread; the returned work completes with `result` or the error."""
        self.failed.check()
        tensors = [t for t in [*inputs, *(result if isinstance(result, list) else [])] if isinstance(t, torch.Tensor)]
        device = _device_of(tensors)
        work = MpiWork(device, result, self._named(name), self.limit, self.failed)
        self._on_the_thread(lambda: work.run(collective), device, inputs)
        return work

    def _on_the_thread(self, call, device: torch.device, inputs=()) -> None:
        """Hands `call` to the communication thread, after what the group handed it before (the ranks' calls stay
        in program order); without one, runs it now. On a GPU the caching allocator keeps `inputs` until the
        thread's stream has read them."""
        thread = self.comm.communication_thread
        if thread is None:
            call()
            return

        def run():
            if device.type == "cuda":
                for tensor in inputs:
                    tensor.record_stream(torch.cuda.current_stream(device))
            call()
        thread.start(run, device)

    def _named(self, name: str) -> str:
        return f"{name} on rank {self.comm.rank} of {self.comm.world_size}"



def call_limit(timeout: float) -> float:
    """A torch group's limit on one call: its `timeout` (seconds), or FSDP_MPI_TIMEOUT where that is set and
    smaller; 0 there means no limit."""
    if not read_text(TIMEOUT):
        return timeout
    ours = read_seconds(TIMEOUT)
    return ours if ours == 0 or timeout <= 0 else min(timeout, ours)



def _device_of(tensors) -> torch.device:
    first = next((t for t in tensors if isinstance(t, torch.Tensor)), None)
    return first.device if first is not None else torch.device("cpu")

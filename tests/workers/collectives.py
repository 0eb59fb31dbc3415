"""Every collective, for every dtype, direct, staged and through the node's shared memory, whole and chunked,
against closed forms (any rank count); with ``--device cuda``, on the GPU (``on_the_gpu``).

With S elements per rank: rank r's shard arange(S) + r*S gathers to arange(N*S);
rank r's full buffer (r + 1) * arange(N*S) averages to (N + 1) / 2 * arange(N*S).
All values are small integers (or halves), exact in every dtype tested.
"""

import sys
import time

import torch
from common import output_path, take_device_argument, write_json
from mpi4py import MPI

from fsdp_mpi import Communicator
from fsdp_mpi.communication.settings import EMULATED_NODE_SIZE, read_count
from fsdp_mpi.communication.machinery.mpi_library import cuda_awareness, is_intel_mpi
from fsdp_mpi.communication.machinery.mpi_buffers import BIT_TYPES, DeviceBuffer
from fsdp_mpi.communication.machinery.worker import threads_may_call_mpi_at_once

S = 5
DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "int64": torch.int64, "int32": torch.int32, "int8": torch.int8}  # int8's sums wrap, alike everywhere


def check(comm: Communicator, dtype: torch.dtype, device: torch.device = torch.device("cpu")) -> dict:
    n, r = comm.world_size, comm.rank
    everything = torch.arange(n * S, dtype=dtype, device=device)
    total = everything * (n * (n + 1) // 2)  # the sum of everything * (rank + 1) over ranks
    mine = slice(r * S, (r + 1) * S)
    results = {}

    full = torch.empty(n * S, dtype=dtype, device=device)
    comm.all_gather_into(full, everything[mine].clone())
    results["all_gather"] = torch.equal(full, everything)
    full = torch.empty(n * S, dtype=dtype, device=device)
    comm.start_all_gather_into(full, everything[mine].clone()).wait()
    results["start_all_gather"] = torch.equal(full, everything)

    shard = torch.empty(S, dtype=dtype, device=device)
    comm.reduce_scatter_sum(shard, everything * (r + 1))
    results["reduce_scatter_sum"] = torch.equal(shard, total[mine])
    shard = torch.empty(S, dtype=dtype, device=device)
    comm.start_reduce_scatter_sum(shard, everything * (r + 1)).wait()
    results["start_reduce_scatter_sum"] = torch.equal(shard, total[mine])
    summed = everything * (r + 1)
    comm.all_reduce_sum_(summed)
    results["all_reduce_sum"] = torch.equal(summed, total)

    tensor = torch.full((3, 4), float(r + 1), dtype=dtype, device=device)
    comm.broadcast_(tensor, root=n - 1)
    results["broadcast"] = torch.equal(tensor, torch.full((3, 4), float(n), dtype=dtype, device=device))

    spacing_of_one_at = {torch.bfloat16: 256.0, torch.float16: 2048.0}.get(dtype)
    if spacing_of_one_at:  # where the next 16-bit value is 2 away: rank 0 adds that, the others 1 each
        parts = torch.full((n * S,), spacing_of_one_at if r == 0 else 1.0, dtype=dtype, device=device)
        summed, shard = parts.clone(), torch.empty(S, dtype=dtype, device=device)
        comm.all_reduce_sum_(summed)
        comm.reduce_scatter_sum(shard, parts)
        started = torch.empty(S, dtype=dtype, device=device)
        comm.start_reduce_scatter_sum(started, parts).wait()
        # in fp32, rounded once: 256 + (n - 1); summed in 16 bits, each 1 would be rounded away
        expected = torch.full((n * S,), spacing_of_one_at + n - 1, dtype=torch.float32, device=device).to(dtype)
        results["16-bit sums in fp32"] = (torch.equal(summed, expected) and torch.equal(shard, expected[mine])
                                          and torch.equal(started, expected[mine]))

    received = torch.empty(n * S, dtype=dtype, device=device)
    comm.all_to_all(received, everything + r)  # chunk j of rank i's is everything[j-th] + i
    results["all_to_all"] = torch.equal(received.view(n, S), everything[mine].expand(n, S) +
                                        torch.arange(n, dtype=dtype, device=device)[:, None])
    return results


def logical_sums(comm: Communicator, device: torch.device = torch.device("cpu")) -> dict:
    """bool sums are a logical or on every route (torch's ``+`` on booleans): rank r sets the elements i with
    i % n == r, so that every element ends set; a sum of all-false stays false."""
    n, r = comm.world_size, comm.rank
    flags = torch.arange(n * S, device=device) % n == r
    summed, shard, none = flags.clone(), torch.empty(S, dtype=torch.bool, device=device), torch.zeros_like(flags)
    comm.all_reduce_sum_(summed)
    comm.reduce_scatter_sum(shard, flags)
    comm.all_reduce_sum_(none)
    return {"bool sums are a logical or": bool(summed.all() and shard.all() and not none.any())}


def empty(comm: Communicator, device: torch.device = torch.device("cpu")) -> dict:
    """Collectives of no elements, on every route and kind of call: nothing to move, and no error (every rank
    raises alike where one is refused, before any MPI call)."""
    try:
        for dtype in (torch.float32, torch.bfloat16):
            none = torch.empty(0, dtype=dtype, device=device)
            comm.all_gather_into(none, none.clone())
            comm.reduce_scatter_sum(none, none.clone())
            comm.all_reduce_sum_(none)
            comm.all_to_all(none, none.clone())
            comm.broadcast_(none, root=comm.world_size - 1)
            comm.start_all_gather_into(none, none.clone()).wait()
            comm.start_reduce_scatter_sum(none, none.clone()).wait()
    except (RuntimeError, ZeroDivisionError) as refused:
        print(f"rank {comm.rank}: a collective of no elements: {refused!r}", file=sys.stderr)
        return {"collectives of no elements": False}
    return {"collectives of no elements": True}


def device_buffers(comm: Communicator, dtype: torch.dtype) -> dict:
    """The CUDA-aware path's buffers, over host memory standing in for device memory (as mpi4py's own tests
    fake device arrays): MPI is handed each tensor's own address and length, and moves the same bits."""
    n, r = comm.world_size, comm.rank
    everything = torch.arange(n * S, dtype=dtype)
    send = torch.zeros(S + 1, dtype=dtype)[1:]  # views that start inside their allocation
    send.copy_(everything[r * S:(r + 1) * S])
    received = torch.zeros(n * S + 2, dtype=dtype)[2:]
    send_buffer, received_buffer = DeviceBuffer(send), DeviceBuffer(received)
    interface = send_buffer.__cuda_array_interface__
    mpi_type = BIT_TYPES[dtype.itemsize]
    comm.mpi_comm.Allgather([send_buffer, mpi_type], [received_buffer, mpi_type])
    return {"device_buffer_is_the_tensor": interface["data"] == (send.data_ptr(), False)
            and interface["shape"] == (S * dtype.itemsize,) and interface["typestr"] == "|u1"
            and received_buffer.address == received.data_ptr(),
            "device_buffer_all_gather": torch.equal(received, everything)}


def started_while_the_partner_is_away(comm: Communicator, dtype: torch.dtype) -> dict:
    """A started staged collective returns before its partners have joined: the communication thread runs it.

    Rank 0 starts an all-gather, then messages rank 1 over a side channel; rank 1
    joins the all-gather only after that message (or, if it never comes, after
    3 s, a thousand times what a start that returns takes, and reports that
    start blocked). Then the same for a reduce-scatter.
    """
    side = comm.mpi_comm.Dup()
    comm.transport(torch.device("cpu"))  # the route is chosen at the first collective on host memory, by all ranks
    n, r = comm.world_size, comm.rank
    everything = torch.arange(n * S, dtype=dtype)
    results = {}
    for what in ("start_all_gather", "start_reduce_scatter_sum"):
        received = torch.empty(n * S if what == "start_all_gather" else S, dtype=dtype)
        returned_first = True
        if r == 1:
            deadline = time.monotonic() + 3
            while not side.Iprobe(source=0) and time.monotonic() < deadline:
                time.sleep(0.01)
            returned_first = side.Iprobe(source=0)
        if what == "start_all_gather":
            pending = comm.start_all_gather_into(received, everything[r * S:(r + 1) * S].clone())
        else:
            pending = comm.start_reduce_scatter_sum(received, everything * (r + 1))
        if r == 0:
            side.send("returned", dest=1)
        pending.wait()
        if r == 1:
            side.recv(source=0)
        expected = everything if what == "start_all_gather" else everything[r * S:(r + 1) * S] * (n * (n + 1) // 2)
        results[f"{what}/returns_before_the_partner_joins"] = returned_first
        results[f"{what}/in_background_equals"] = torch.equal(received, expected)
    side.Free()
    return results


def dtypes_handed_to_the_worker(comm: Communicator, dtype: torch.dtype) -> list | None:
    """The dtypes of the tensors that a started staged reduce-scatter of `dtype` hands the communication thread:
    16-bit ones must arrive in fp32, cast by the caller (on a GPU, on its stream and from its memory pool).
    None where the communicator has no communication thread."""
    if comm.communication_thread is None:
        return None
    handed, start = [], comm.communication_thread.start

    def recorded(collective, device, keep=()):  # keep: the buffers the collective works on
        handed.extend(buffer.dtype for buffer in keep)
        return start(collective, device, keep)
    comm.communication_thread.start = recorded
    shard = torch.empty(S, dtype=dtype)
    comm.start_reduce_scatter_sum(shard, torch.ones(comm.world_size * S, dtype=dtype)).wait()
    comm.communication_thread.start = start
    return handed if torch.equal(shard, torch.full((S,), float(comm.world_size), dtype=dtype)) else []


def an_object_between_two_ranks(comm: Communicator) -> bool:
    """``send_object`` from the last rank to rank 0 (what a twin sends a grow-back's newcomer): nested containers,
    tensors of several dtypes among them (a non-contiguous bf16 view, a 0-d int64, an empty one, one twice) and
    plain values arrive equal, each tensor with its dtype and shape."""
    generator = torch.Generator().manual_seed(7)
    weights = torch.randn(5, 3, generator=generator)
    sent = {"shards": {"w": weights, "b16": torch.randn(3, 4, generator=generator).to(torch.bfloat16).t()},
            "state": [torch.tensor(11, dtype=torch.int64), torch.empty(0), weights, ("step", 3, 0.5)]}
    if comm.rank == comm.world_size - 1:
        comm.send_object(sent, 0)
        return True
    if comm.rank != 0:
        return True
    got = comm.receive_object(comm.world_size - 1)
    tensors = [(got["shards"]["w"], sent["shards"]["w"]), (got["shards"]["b16"], sent["shards"]["b16"]),
               *zip(got["state"][:3], sent["state"][:3])]
    return (all(a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) for a, b in tensors)
            and got["state"][3] == ("step", 3, 0.5))


def spans_nodes() -> bool:
    """With FSDP_MPI_EMULATED_NODE_SIZE the ranks span nodes: every collective goes in two levels, inside each node
    by the route a communicator is asked for (MPI, staged or the node's memory), across nodes by MPI."""
    return (read_count(EMULATED_NODE_SIZE) or MPI.COMM_WORLD.Get_size()) < MPI.COMM_WORLD.Get_size()


def on_the_gpu(device: torch.device) -> dict:
    """Device tensors through the node transport (CUDA IPC), the staged path and, where MPI is CUDA-aware (Intel
    MPI with I_MPI_OFFLOAD=1), straight to MPI, on the GPU of each rank's place on its node (ranks may share one):
    the closed forms, whole and in exchanges of 16 bytes, collectives started on the communication thread, and
    64 MiB of random values, bit for bit the node transport's on every other route."""
    report, results = {}, {}
    for route in ("node", "staged", *(("direct",) if cuda_awareness().aware else ())):
        for chunk in (None, 16):
            comm = Communicator(force_staging=route == "staged", node_transport=route == "node")
            if chunk:
                comm.node_exchange_bytes = comm.staging_chunk_bytes = chunk
            for name, dtype in DTYPES.items():
                for what, ok in check(comm, dtype, device).items():
                    report[f"cuda/{what}/{name}/{route}/chunk={chunk}"] = all(comm.all_gather_object(ok))
            for what, ok in {**logical_sums(comm, device), **empty(comm, device)}.items():
                report[f"cuda/{what}/{route}/chunk={chunk}"] = all(comm.all_gather_object(ok))
            expected = "two-level" if spans_nodes() else route
            report[f"cuda/route/{route}/chunk={chunk}"] = comm.routes == {"cuda": expected}
        comm = Communicator(force_staging=route == "staged", node_transport=route == "node")  # whole chunks
        numel = 2**24 // comm.world_size  # 64 MiB of fp32 in all, per collective
        generator = torch.Generator(device).manual_seed(comm.rank)
        full = torch.randn(numel * comm.world_size, generator=generator, device=device)
        gathered, shard = torch.empty_like(full), torch.empty(numel, device=device)
        comm.all_gather_into(gathered, full[:numel].clone())
        comm.reduce_scatter_sum(shard, full)
        results[route] = (gathered, shard)
    for route in [route for route in results if route != "node"]:  # in one order on every rank
        report[f"cuda/64 MiB node == {route}, bit for bit"] = all(comm.all_gather_object(
            all(torch.equal(a, b) for a, b in zip(results["node"], results[route]))))
    # After all that, on the communication thread too: a CUDA context on this rank's GPU only (each costs about
    # 0.5 GiB of the GPU it is on; with one GPU for all ranks there is no other).
    others = [index for index in range(torch.cuda.device_count())
              if index != device.index and torch._C._cuda_hasPrimaryContext(index)]
    report["cuda/no CUDA context on another rank's GPU"] = all(comm.all_gather_object(others == []))
    return report


if __name__ == "__main__":
    if (device := take_device_argument()).type == "cuda":
        write_json(output_path(), on_the_gpu(device))
        sys.exit(0)
    report = {}
    for route in ("direct", "staged", "node"):
        for chunk in (None, 2):
            comm = Communicator(force_staging=route == "staged", node_transport=route == "node")
            if chunk:  # several messages, pipeline chunks or exchanges per collective
                comm.max_elements_per_message = chunk
                comm.node_exchange_bytes = 2 * 8
            for name, dtype in DTYPES.items():
                for what, ok in check(comm, dtype).items():
                    report[f"{what}/{name}/{route}/chunk={chunk}"] = all(comm.all_gather_object(ok))
            for what, ok in {**logical_sums(comm), **empty(comm)}.items():
                report[f"{what}/{route}/chunk={chunk}"] = all(comm.all_gather_object(ok))
            report[f"host buffers used if and only if staged, shared memory if node/{route}/chunk={chunk}"] = (
                bool(comm.staging_slots) is (route == "staged")
                and comm.routes == {"cpu": "two-level" if spans_nodes() else route})
    for name, dtype in DTYPES.items():
        for what, ok in device_buffers(comm, dtype).items():
            report[f"{what}/{name}"] = all(comm.all_gather_object(ok))
    staged = Communicator(force_staging=True)
    for what, ok in started_while_the_partner_is_away(staged, torch.float32).items():
        report[f"{what}/staged"] = all(staged.all_gather_object(ok))
    summed_by = torch.bfloat16 if spans_nodes() else torch.float32  # two levels sum 16-bit values in fp32 themselves
    report["a started 16-bit reduce-scatter reaches the worker in fp32 where MPI sums it"] = all(
        staged.all_gather_object(dtypes_handed_to_the_worker(staged, torch.bfloat16)
                                 == ([summed_by, summed_by] if threads_may_call_mpi_at_once() else None)))
    line = comm.describe_route(torch.device("cpu"))
    report["the route line says what I_MPI_OFFLOAD would change, under Intel MPI alone"] = (
        "I_MPI_OFFLOAD unset: device buffers would be staged through the host" in line) is is_intel_mpi()
    report["an object's tensors and values from one rank to another"] = all(
        comm.all_gather_object(an_object_between_two_ranks(comm)))
    report["sum_and_max_of_floats"] = [comm.all_reduce_sum_float(comm.rank + 0.5),
                                       comm.all_reduce_max_float(-comm.rank)]
    write_json(output_path(), report)

"""Collectives started without waiting (``Communicator.start_*``): how each runs meanwhile, and ``Pending``,
whose ``wait()`` completes it.

A started collective runs in one of three ways, chosen here per call:

- on the communication thread (``background.py``), where that is host work that would
  otherwise hold the main thread (``routes.runs_on_the_communication_thread``): staging,
  and anything on device memory;
- as a nonblocking MPI call, where MPI reads host memory directly in one message: MPI
  moves the data when its progress engine runs, inside later MPI calls, or in the
  background where the library has a progress thread or offloads to hardware;
- to its end before ``start_*`` returns, otherwise (a node transfer of host memory:
  copies the CPU would make anyway; a message cut in several).

`comm` below is the ``Communicator`` that starts the collective.
"""

from functools import partial
from typing import Callable

import torch
from mpi4py import MPI

from fsdp_mpi.communication.background import OnWorker
from fsdp_mpi.communication.bookkeeping import in_mpi, waiting_in_mpi
from fsdp_mpi.communication.collective_log import CollectiveRecord
from fsdp_mpi.communication.mpi_buffers import (SUM_IN_FP32, as_bits, as_numbers, check_full_and_shard,
                                                wait_for_producer)
from fsdp_mpi.communication.routes import Route, runs_on_the_communication_thread


class Pending:
    """A collective started without waiting; ``wait()`` completes it (once; later calls do nothing).

    Holds the buffers MPI is still reading or writing, so that a caller dropping its
    own references (a temporary send buffer, say) cannot free them under MPI.

    Args:
        comm: the ``Communicator`` that started it (its waits are watched and timed there).
        request: a nonblocking MPI call's request, and `record` its entry in the collective log.
        buffers: the tensors to keep alive until ``wait()``.
        on_worker: a collective on the communication thread (``background.py``).
        then: what completes it once the transfer has: a copy back into the caller's tensor.
    """

    def __init__(self, comm, request=None, record: CollectiveRecord | None = None, buffers=(),
                 on_worker: OnWorker | None = None, then: Callable[[], None] | None = None):
        self._comm, self._request, self._record, self._buffers = comm, request, record, buffers
        self._on_worker, self._then = on_worker, then

    def wait(self) -> None:
        if self._request is not None:
            with waiting_in_mpi(self._comm, self._record):
                self._request.Wait()
        if self._on_worker is not None:
            self._on_worker.wait()  # the worker's own collective is watched and timed where it runs
        if self._then is not None:
            self._then()
        self._request, self._on_worker, self._buffers, self._then = None, None, (), None


def _route_if_any(comm, tensor: torch.Tensor) -> Route | None:
    """`tensor`'s route between `comm`'s ranks; None for a group of one rank, which makes no MPI call."""
    return comm.route(tensor.device) if comm.world_size > 1 else None


def _on_the_worker(comm, route: Route | None, tensor: torch.Tensor) -> bool:
    return comm.communication_thread is not None and runs_on_the_communication_thread(route, tensor)


def start_all_gather(comm, full: torch.Tensor, shard: torch.Tensor, unit: str) -> Pending:
    """full (world_size * S,) <- every rank's shard (S,), in rank order, once the returned ``wait()`` returns."""
    check_full_and_shard(full, shard, comm.world_size, "start_all_gather_into")
    route = _route_if_any(comm, full)
    if _on_the_worker(comm, route, full):
        on_worker = comm.communication_thread.start(partial(comm.all_gather_into, full, shard, unit), full.device)
        return Pending(comm, buffers=(full, shard), on_worker=on_worker)
    if route is not Route.DIRECT or shard.numel() > comm.max_elements_per_message:
        comm.all_gather_into(full, shard, unit)
        return Pending(comm)
    comm.bytes_moved["all_gather"] += full.numel() * full.element_size()
    with in_mpi(comm, "all_gather", shard, unit, finishes=False) as record:
        wait_for_producer(shard)
        request = comm.mpi_comm.Iallgather(as_bits(shard), as_bits(full))
    return Pending(comm, request, record, buffers=(full, shard))


def start_reduce_scatter(comm, shard: torch.Tensor, full: torch.Tensor, unit: str) -> Pending:
    """shard (S,) <- the sum over ranks of their full[rank * S:(rank + 1) * S], once ``wait()`` returns.
    Nonblocking MPI reductions of 16-bit values, or of device memory under Open MPI (whose nonblocking
    reductions crash on device buffers), complete before this returns."""
    check_full_and_shard(full, shard, comm.world_size, "start_reduce_scatter_sum")
    route = _route_if_any(comm, full)
    if _on_the_worker(comm, route, full):
        if route is Route.STAGED and shard.dtype in SUM_IN_FP32:
            return _start_reduce_scatter_in_fp32(comm, shard, full, unit)
        on_worker = comm.communication_thread.start(partial(comm.reduce_scatter_sum, shard, full, unit),
                                                    full.device)
        return Pending(comm, buffers=(full, shard), on_worker=on_worker)
    direct = route is Route.DIRECT and shard.numel() <= comm.max_elements_per_message
    if not direct or shard.dtype in SUM_IN_FP32 or (full.is_cuda and not comm.device_reductions_in_background):
        comm.reduce_scatter_sum(shard, full, unit)
        return Pending(comm)
    comm.bytes_moved["reduce_scatter"] += full.numel() * full.element_size()
    with in_mpi(comm, "reduce_scatter", full, unit, finishes=False) as record:
        wait_for_producer(full)
        request = comm.mpi_comm.Ireduce_scatter_block(as_numbers(full), as_numbers(shard), op=MPI.SUM)
    return Pending(comm, request, record, buffers=(full, shard))


def _start_reduce_scatter_in_fp32(comm, shard: torch.Tensor, full: torch.Tensor, unit: str) -> Pending:
    """A 16-bit reduce-scatter for the worker, summed in fp32 as every 16-bit sum through MPI is. The fp32
    copies are made here, on the caller's stream: made by the worker, on its side stream, they would come
    from that stream's share of the caching allocator, which the compute stream cannot reuse (a
    gradient-sized block held apart per unit). ``wait()`` rounds the sum into `shard`."""
    full_fp32 = full.float()  # (world_size * shard_numel,)
    shard_fp32 = torch.empty(shard.numel(), dtype=torch.float32, device=shard.device)
    on_worker = comm.communication_thread.start(partial(comm.reduce_scatter_sum, shard_fp32, full_fp32, unit),
                                                full.device)
    return Pending(comm, buffers=(full_fp32, shard_fp32), on_worker=on_worker,
                   then=lambda: shard.copy_(shard_fp32))

"""The GPU paths' host-side logic on its own, without a GPU (torch's CUDA calls faked where needed): the
communication thread (transports/worker.py: the order it runs collectives in, what waiting for its queue waits for
after an error, how many CUDA streams it makes, which started collectives it runs) and the staging pipeline's wait
for the last collective's copies back (transports/staged.py)."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from fsdp_mpi.communication.transports.direct import Direct
from fsdp_mpi.communication.transports.node import NodeTransport
from fsdp_mpi.communication.transports.staged import RING_SLOTS, Staged, StagedCollectives
from fsdp_mpi.communication.transports.worker import CommunicationThread

pytestmark = pytest.mark.one_mpi  # no MPI in it: CI's second MPI would run it for nothing


def test_the_worker_runs_collectives_one_at_a_time_in_the_order_started():
    """Ranks must enter a communicator's collectives in the same order: the worker runs what it is handed first
    come, first served, one at a time (the first sleeps longest, so any overlap or reordering shows), and
    ``wait_for_all()`` returns only when all have run."""
    thread, log = CommunicationThread(), []

    def collective(index: int):
        def run():
            log.append(f"enter {index}")
            time.sleep(0.05 * (3 - index))
            log.append(f"leave {index}")
        return run

    for index in range(3):
        thread.start(collective(index), torch.device("cpu"))
    thread.wait_for_all()
    assert log == ["enter 0", "leave 0", "enter 1", "leave 1", "enter 2", "leave 2"]


def test_waiting_for_the_queue_waits_for_every_collective_then_raises_the_first_error():
    thread = CommunicationThread()
    finished = threading.Event()

    def fails():
        raise RuntimeError("the first collective failed")

    def slow():
        time.sleep(0.3)
        finished.set()

    thread.start(fails, torch.device("cpu"))
    thread.start(slow, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="the first collective failed"):
        thread.wait_for_all()
    # the worker is no longer inside a collective when the caller goes on to its own
    assert finished.is_set()


def test_started_collectives_of_device_memory_run_on_the_communication_thread_on_every_route():
    """Staged, through the node, and direct (a CUDA-aware MPI, before which the host waits for the stream that
    produced the tensor): on the worker, so the main thread's host runs on ahead; host memory is staged there
    only, other routes start (or complete) on the caller."""
    two_ranks = SimpleNamespace(Get_rank=lambda: 0, Get_size=lambda: 2)  # no MPI in pytest's own process
    transports = [Staged(two_ranks, 2**20, 2**31 - 1), Direct(two_ranks, 2**31 - 1),
                  NodeTransport(two_ranks, slots=None)]
    on_the_worker = {(device, transport.route): transport.runs_started_on_the_worker(
                     SimpleNamespace(is_cuda=device == "cuda")) for device in ("cpu", "cuda") for transport in transports}
    assert on_the_worker == {(device, route): device == "cuda" or route == "staged"
                             for device in ("cpu", "cuda") for route in ("staged", "direct", "node")}


class _FakeEvent:
    def record(self, stream=None):
        pass


def test_one_side_stream_per_device_however_many_collectives_start(monkeypatch):
    made = []
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or object())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: object())
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    monkeypatch.setattr(CommunicationThread, "_run", lambda self, collective, ready, side: None)
    thread = CommunicationThread()
    for _ in range(3):
        thread.start(lambda: None, torch.device("cuda", 0))
    thread.start(lambda: None, torch.device("cuda", 1))
    thread.wait_for_all()
    # torch hands out its pooled streams in turn: a stream made per call would come round to the copy stream's
    assert made == [torch.device("cuda", 0), torch.device("cuda", 1)]


class _CopiesBack:
    """Stands in for the CUDA event that a device collective's copies back record: whether the host waited."""

    def __init__(self):
        self.waited = False

    def synchronize(self):
        self.waited = True


@pytest.mark.one_rank  # in a child: on a machine with a GPU the host buffers are pinned, which starts CUDA
def test_a_cpu_collective_staged_after_a_device_one_waits_for_its_copies_back():
    """FSDP_MPI_FORCE_STAGING=1 on a GPU machine: the host buffers a CPU tensor is staged through may still be
    read by the last device collective's copies back, so the CPU one waits for them too (and only once)."""

    staged = StagedCollectives()
    staged._host_buffers_read = copies_back = _CopiesBack()
    tensor = torch.arange(6.0)
    staged.in_place(tensor, 4, lambda host: host.mul_(2))
    assert copies_back.waited and staged._host_buffers_read is None
    assert tensor.tolist() == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0]


@pytest.mark.one_rank  # in a child: on a machine with a GPU the ring is pinned, which starts CUDA
def test_the_staging_ring_holds_three_chunks_whatever_the_message():
    """Every staged collective, its message 3 ranks x 1000 elements cut into chunks of 64, gives its closed form
    (MPI's part faked as 3 ranks holding the same values, output first), through host slots of 3 chunks each, not
    a message."""

    staged, world, numel, chunk = StagedCollectives(), 3, 1000, 64
    shard = torch.arange(numel, dtype=torch.float32)
    full = torch.empty(world * numel)
    staged.all_gather(full, shard, chunk, lambda out, chunk_in: out.copy_(chunk_in.repeat(world)))
    assert torch.equal(full, shard.repeat(world))
    summed = torch.empty(numel)
    staged.reduce_scatter(summed, full * 2, chunk, lambda out, chunk_in: out.copy_(chunk_in.view(world, -1).sum(0)))
    assert torch.equal(summed, shard * 2 * world)
    received = torch.empty(world * numel)
    staged.all_to_all(received, full + 1, world, chunk, lambda out, chunk_in: out.copy_(chunk_in))
    assert torch.equal(received, full + 1)
    staged.in_place(full, chunk, lambda host: host.mul_(3))
    assert torch.equal(full, shard.repeat(world) * 3)
    widest = {"all_gather_send": chunk, "all_gather_recv": world * chunk, "reduce_scatter_send": world * chunk,
              "reduce_scatter_recv": chunk, "all_to_all_send": world * chunk, "all_to_all_recv": world * chunk,
              "in_place": chunk}
    assert staged.buffers.slots == sorted(widest)
    for name in widest:
        assert staged.buffers.get(name, 1, torch.uint8).untyped_storage().nbytes() == RING_SLOTS * widest[name] * 4

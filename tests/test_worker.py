"""The communication thread (fsdp_mpi/communication/machinery/worker.py) on its own, without a GPU (torch's CUDA
calls faked where needed): the order it runs collectives in, what waiting for its queue waits for after an error,
how many CUDA streams it makes, which started collectives it runs. (The MPI programs that tests launch are in
tests/workers/, a different thing.)"""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from fsdp_mpi.communication.transports.direct import Direct
from fsdp_mpi.communication.transports.node import NodeTransport
from fsdp_mpi.communication.transports.staged import Staged
from fsdp_mpi.communication.machinery.worker import CommunicationThread

pytestmark = pytest.mark.one_mpi  # no MPI in it: CI's second MPI would run it for nothing

# A worker thread never ends: in pytest's own process it would be there at every later one_rank test's fork()
# (a lock it holds stays held in the child; Python 3.12 and later warn). So the tests that start one are marked
# one_rank: they run in a child, and the thread ends with it.


@pytest.mark.one_rank
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


@pytest.mark.one_rank
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


@pytest.mark.one_rank
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

"""The communication thread (fsdp_mpi/communication/background.py) on its own, without MPI: what waiting for
its queue waits for after an error, and how many CUDA streams it makes (with torch's CUDA calls faked)."""

import threading
import time

import pytest
import torch

from fsdp_mpi.communication.background import CommunicationThread


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

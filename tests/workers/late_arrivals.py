"""Offload whose gradients come home late, as they do from a GPU, on a machine without one.

From a GPU an offloaded gradient shard is copied home behind the reduction, into
pinned memory, and only its wait says it is there (``fsdp_mpi.sharding.offload``'s
``copy_home``). On the CPU the copy is made at once, so a reader that forgot to
wait would still read the right numbers. ``ArrivingLate`` makes the CPU behave as
the GPU may: each copy's memory holds NaN until a wait lands it, and a wait lands
every copy made before it too, as the events of one stream do. A gradient read
before its wait then makes the training differ from the reference (NaN is
unequal to everything), wherever the reader is.
"""

import threading
from collections import deque

import torch

from fsdp_mpi import CPUOffload


class ArrivingLate(CPUOffload):
    """``CPUOffload(offload_params=True)`` whose copies home land only when waited for (shared by every handle
    of a model, as a device's stream home is; the host thread that steps inside backward waits too)."""

    def __init__(self):
        super().__init__(offload_params=True)
        object.__setattr__(self, "_in_flight", deque())  # (number, home, the values it will hold), oldest first
        object.__setattr__(self, "_made", [0])
        object.__setattr__(self, "_lock", threading.Lock())

    def copy_home(self, shard_grad: torch.Tensor, shard: torch.Tensor):
        values, _ = super().copy_home(shard_grad, shard)
        home = torch.full_like(values, float("nan"))
        with self._lock:
            self._made[0] += 1
            number = self._made[0]
            self._in_flight.append((number, home, values))

        def wait() -> None:
            with self._lock:
                while self._in_flight and self._in_flight[0][0] <= number:
                    _, landing, landed_values = self._in_flight.popleft()
                    landing.copy_(landed_values)
        return home, wait

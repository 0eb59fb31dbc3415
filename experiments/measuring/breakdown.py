"""Where one fsdp-mpi training step's time goes, on each rank: bench_worker's breakdown of a step.

    step = compute + gradient assembly + hooks' own work + MPI (waiting for the slower rank + moving data)

- **MPI** is the time the communicator spent blocked in MPI calls (``Communicator.seconds_in_mpi``).
  Of it, **waiting** is, per collective, how much later than this rank the last rank entered it
  (capped at the time this rank spent in it), read from the collective log's entry times: the part
  of MPI that a faster network would not shorten. **Moving** is the rest: MPI copying and reducing.
  Entry times are compared across processes, so this needs the ranks on one host (the monotonic clock
  is the machine's); across hosts waiting and moving are left out.
- **Hooks' own work** is the time inside the unit lifecycle's hooks (gather before forward and
  backward, free after, reduce after a unit's backward, the end of backward) less MPI: Python,
  views, allocating and freeing the gathered buffers, casts.
- **Gradient assembly** is ``FullViews.backward``: the copy of each parameter's gradient into the
  flat gradient that is reduce-scattered (a copy one process does not make).
- **Compute** is the rest of the step: forward and backward arithmetic, the loss, the optimizer.

The timers listen at the core's timing points (``fsdp_mpi/communication/timing_points.py``: the
lifecycle's hooks, gradient assembly, each collective entered), so the library carries no profiling
code and a rename in it cannot silently hide a hook from the breakdown; each costs two clock reads
per hook call, microseconds against a step of seconds.
"""

import socket
import time

from fsdp_mpi import Communicator
from fsdp_mpi.communication.timing_points import GRADIENT_ASSEMBLY, HOOK, add_listener


class StepBreakdown:
    """Accumulates, per step, the seconds in the lifecycle's hooks and in gradient assembly, and the
    collectives entered; ``parts`` turns them into the step's parts (``reported.PARTS``)."""

    def __init__(self):
        self.hook_seconds = 0.0
        self.assembly_seconds = 0.0
        self.records = []  # every collective entered since start_step()
        # Per timing point, the calls open now and when the outermost began: hooks inside hooks (a part's
        # forward calls the unit's) count once.
        self._depth = {HOOK: 0, GRADIENT_ASSEMBLY: 0}
        self._started = {HOOK: 0.0, GRADIENT_ASSEMBLY: 0.0}

    def install(self) -> None:
        """Listens at the core's timing points (any time before the step to measure)."""
        add_listener(self)

    def enter(self, point: str) -> None:
        if point in self._depth:
            if self._depth[point] == 0:
                self._started[point] = time.perf_counter()
            self._depth[point] += 1

    def leave(self, point: str) -> None:
        if point in self._depth:
            self._depth[point] -= 1
            if self._depth[point] == 0:
                seconds = time.perf_counter() - self._started[point]
                if point == HOOK:
                    self.hook_seconds += seconds
                else:
                    self.assembly_seconds += seconds

    def collective_started(self, record) -> None:
        self.records.append(record)

    def start_step(self) -> None:
        self.hook_seconds = self.assembly_seconds = 0.0
        self.records = []

    def end_step(self) -> tuple[float, float, list[tuple]]:
        """What the step recorded (before any collective of the timing's own is logged)."""
        entries = [(record.fingerprint(), record.started, (record.finished or record.started) - record.started)
                   for record in self.records]
        return self.hook_seconds, self.assembly_seconds, entries

    @staticmethod
    def parts(recorded: tuple, step_seconds: float, mpi_seconds: float, comm: Communicator) -> dict:
        """This rank's step in ``reported.PARTS``, from ``end_step()``'s record (collective: every rank calls it)."""
        hook_seconds, assembly_seconds, entries = recorded
        every_rank = comm.all_gather_object((socket.gethostname(), entries))
        waiting = None
        same_collectives = all([entry[0] for entry in theirs] == [entry[0] for entry in entries]
                               for _, theirs in every_rank)
        if len({host for host, _ in every_rank}) == 1 and same_collectives:
            waiting = 0.0
            for index, (_, entered, took) in enumerate(entries):
                last_entry = max(theirs[index][1] for _, theirs in every_rank)
                waiting += min(max(last_entry - entered, 0.0), took)
        return {"compute_s": step_seconds - hook_seconds - assembly_seconds,
                "gradient_assembly_s": assembly_seconds,
                "hooks_own_s": hook_seconds - mpi_seconds,
                "mpi_waiting_s": waiting,
                "mpi_moving_s": None if waiting is None else mpi_seconds - waiting}

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

The timers wrap the lifecycle's methods from outside the library (``StepBreakdown.install``, before
the model is wrapped, since hooks bind their methods then), so the library carries no profiling
code; each costs two clock reads per hook call, microseconds against a step of seconds.
"""

import socket
import time

from fsdp_mpi import Communicator
from fsdp_mpi.communication.collective_log import PROCESS_LOG
from fsdp_mpi.sharding.flat_param import FullViews
from fsdp_mpi.sharding.lifecycle import ShardedUnit

HOOKS = ("_pre_forward", "_post_forward", "_pre_backward", "_post_backward", "_end_of_backward")
PARTS = ("compute_s", "gradient_assembly_s", "hooks_own_s", "mpi_waiting_s", "mpi_moving_s")


class StepBreakdown:
    """Accumulates, per step, the seconds in the lifecycle's hooks and in gradient assembly, and the
    collectives entered; ``parts`` turns them into the step's parts (``PARTS``)."""

    def __init__(self):
        self.hook_seconds = 0.0
        self.assembly_seconds = 0.0
        self.records = []  # every collective entered since start_step()
        self._depth = 0  # hooks inside hooks (a part's forward calls the unit's) count once

    def install(self) -> None:
        """Wraps the lifecycle's hooks and FullViews.backward with timers, and keeps the collective log's records."""
        for name in HOOKS:
            setattr(ShardedUnit, name, self._timed_hook(getattr(ShardedUnit, name)))
        assemble = FullViews.backward

        def timed_assembly(ctx, *grads):
            start = time.perf_counter()
            try:
                return assemble(ctx, *grads)
            finally:
                self.assembly_seconds += time.perf_counter() - start
        FullViews.backward = staticmethod(timed_assembly)
        begin = PROCESS_LOG.begin

        def kept(*args):
            record = begin(*args)
            self.records.append(record)
            return record
        PROCESS_LOG.begin = kept

    def _timed_hook(self, hook):
        def timed(*args, **kwargs):
            self._depth += 1
            start = time.perf_counter()
            try:
                return hook(*args, **kwargs)
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self.hook_seconds += time.perf_counter() - start
        return timed

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
        """This rank's step in PARTS, from ``end_step()``'s record (collective: every rank calls it)."""
        hook_seconds, assembly_seconds, entries = recorded
        every_rank = comm.allgather_object((socket.gethostname(), entries))
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

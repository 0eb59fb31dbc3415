"""``InFlight``: the one name for a collective started and not yet waited for, whichever way it runs.

A prefetch or an asynchronous reduce-scatter returns one. What completes it is a
list of steps run in order at ``wait()``: waiting for a nonblocking MPI request,
joining the communication thread, copying a result back, decoding compressed
bytes. The sharding layer only calls ``wait()`` and reads the result.
"""

from typing import Callable


class InFlight:
    """A started collective; ``wait()`` runs its steps once, in order, and returns its result (a tensor, or None).

    `keep` holds the buffers MPI may still read or write until then, so that a caller dropping its own
    references (a temporary send buffer, say) cannot free them under MPI.
    """

    __slots__ = ("result", "_steps", "_keep")

    def __init__(self, result=None, steps: tuple[Callable[[], None], ...] = (), keep: tuple = ()):
        self.result, self._steps, self._keep = result, list(steps), keep

    def then(self, step: Callable[[], None] | None, result=None) -> "InFlight":
        """Adds `step` (if any) after the others, and `result` (if given) as what ``wait()`` returns."""
        if step is not None:
            self._steps.append(step)
        if result is not None:
            self.result = result
        return self

    def wait(self):
        steps, self._steps = self._steps, []
        for step in steps:
            step()
        self._keep = ()
        return self.result

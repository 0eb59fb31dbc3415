"""The order in which units run their forward, recorded once, so that the next unit can be prefetched.

Backward visits the units in the reverse order. The order is recorded during the
first forward pass and then kept: ranks must run the same units in the same
order, so every rank prefetches the same unit at the same moment and their
collectives stay matched.
"""


class ExecutionOrder:
    def __init__(self):
        self.units: list = []
        self.recording = True

    def record(self, unit) -> None:
        if self.recording and not any(u is unit for u in self.units):
            self.units.append(unit)

    def stop_recording_unless_empty(self) -> None:
        """A whole forward has ended: keep the order it recorded, or go on recording if it recorded no unit
        (a forward without units, e.g. one that ran only a part)."""
        self.recording = not self.units

    def after(self, unit):
        """The unit whose forward comes next (None if unknown or last)."""
        index = self._index(unit)
        return self.units[index + 1] if index is not None and index + 1 < len(self.units) else None

    def before(self, unit):
        """The unit whose backward comes next: the one that ran forward before `unit`."""
        index = self._index(unit)
        return self.units[index - 1] if index else None

    def _index(self, unit) -> int | None:
        if self.recording:
            return None
        return next((i for i, u in enumerate(self.units) if u is unit), None)

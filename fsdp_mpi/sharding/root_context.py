"""The bookkeeping of one tree of units, kept once by its root and shared by every unit in it.

Units are built bottom-up, and each is the root of what it wraps until an outer
unit is built around it; the outermost one's ``RootContext`` is the one that
counts, and every unit reaches it as ``unit.root.context`` (torch FSDP2's
``FSDPStateContext``). A nested unit keeps none of it and writes no other unit's
fields: it asks the context (leave a reduction in flight, queue the end of backward).

It is also where a gradient consumer plugs in: ``loop/step_in_backward.py``
steps the optimizer on each handle whose gradient a reduction has just made
final, and the context tells it when (``gradient_reduced``, ``backward_reduced``).
"""

from torch.autograd import Variable

from fsdp_mpi.sharding.execution_order import ExecutionOrder
from fsdp_mpi.sharding.flat_param import FlatParamHandle


class RootContext:
    """Every unit of the tree, the order they run forward in, the one asynchronous gradient reduction
    still running, whether this backward's end-of-backward step is queued, and who consumes the reduced
    gradients as they come.

    Args:
        units: every unit of the tree, outermost first: the order of the end-of-backward step, the same on
            every rank.
    """

    def __init__(self, units: list):
        self.units = units
        self.execution_order = ExecutionOrder()
        self._reduction_in_flight: FlatParamHandle | None = None
        self._end_of_backward_queued = False
        # While ``step_in_backward`` is entered: its stepper, told of each reduced gradient (duck-typed: the
        # loop layer sits above this one). And whether the last backward stepped the optimizer (then its
        # gradients are spent: clip_grad_norm_ refuses), until the next backward.
        self.gradient_consumer = None
        self.stepped_in_backward = False

    def leave_in_flight(self, handle: FlatParamHandle) -> None:
        """`handle`'s gradient reduction was only started; ``finish_reduction_in_flight()`` completes it."""
        self._reduction_in_flight = handle

    def finish_reduction_in_flight(self) -> None:
        """Completes the reduction left in flight, if any (at most one is, to bound the gradient memory held)."""
        if self._reduction_in_flight is not None:
            handle, self._reduction_in_flight = self._reduction_in_flight, None
            handle.gradient.finish_reduction()
            self.gradient_reduced(handle)

    def gradient_reduced(self, handle: FlatParamHandle) -> None:
        """`handle`'s gradient was reduced in a synchronised backward: its shard's ``.grad`` is final unless some
        parameter of it got no gradient on this rank (the end of backward decides those)."""
        if self.gradient_consumer is not None:
            self.gradient_consumer.gradient_reduced(handle)

    def backward_reduced(self) -> None:
        """A synchronised backward's end: every gradient is reduced, and ``.grad`` is None wherever no rank used
        a parameter."""
        if self.gradient_consumer is not None:
            self.gradient_consumer.backward_reduced([handle for unit in self.units for handle in unit.handles])
            self.stepped_in_backward = True

    def queue_end_of_backward(self, end_of_backward) -> None:
        """Has autograd call `end_of_backward` once, when this backward finishes (however many units ask)."""
        if not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            self.stepped_in_backward = False
            Variable._execution_engine.queue_callback(end_of_backward)

    def end_of_backward_done(self) -> None:
        """The queued end-of-backward step has run: the next backward queues its own."""
        self._end_of_backward_queued = False

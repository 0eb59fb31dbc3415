"""The optimizer's step inside backward: each handle's shard steps as soon as its gradient is final.

    with step_in_backward(model, optimizer):
        loss.backward()          # the optimizer has stepped, and the gradients are cleared
    scheduler.step()

Why: offloaded (``CPUOffload``) with units on a GPU, the optimizer steps host
shards on the CPU, and after backward that step is time the GPU waits. Here the
units whose gradients are home step on a host thread while the GPU computes the
rest of backward (ZeRO-Offload's overlap). Elsewhere the step runs inline, in
the same order, with nothing to overlap (on a CPU the host is the device), and
each handle's gradient is freed as soon as it has stepped, so that the rest of
backward runs without it.

How: one ordinary optimizer over the model's parameters (the sharded views),
stepped one handle at a time: for each step its param groups list only that
handle's views, so its hyperparameters, schedulers, state and ``state_dict`` are
the optimizer's own. For an optimizer that updates each parameter from its own
gradient and state alone (every ``torch.optim`` one but LBFGS) this is the
same step as one ``optimizer.step()`` after backward, to the bit.

When a handle steps: after its reduction in a synchronised backward, if this
rank used every parameter of it (then some rank did, so none of them is to be
left without a gradient); otherwise at the end of backward, once the ranks have
agreed which parameters got no gradient (``lifecycle.py``). A backward under
``no_sync()`` reduces nothing and so steps nothing: accumulate under ``no_sync()``
and let the last micro-batch's backward step. Clipping needs every gradient
before any step: ``clip_grad_norm_`` refuses after a stepped backward. fp16 loss
scaling cannot skip a step it has not seen yet: fp16 is refused; bf16 needs none.
"""

from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager

import torch
from torch import nn

from fsdp_mpi.sharding.flat_param import FlatParamHandle
from fsdp_mpi.sharding.lifecycle import require_units_with_names


@contextmanager
def step_in_backward(model: nn.Module, optimizer: torch.optim.Optimizer, on_host_thread: bool | None = None):
    """Within it, every synchronised backward of the sharded `model` also steps `optimizer` (and clears the
    gradients it stepped with), a handle at a time as their gradients become final.

    Args:
        model: a ``FullyShardedDataParallel`` model (its root unit).
        optimizer: built over the model's parameters, as for ``optimizer.step()``.
        on_host_thread: step on a thread of its own, overlapped with the rest of backward; None: where the
            shards are offloaded to host memory and the units compute on a GPU (``CPUOffload.copies_to_device``).
    """
    units = [unit for _, unit in require_units_with_names(model, "step_in_backward")]
    if not units[0].is_root:
        raise ValueError("step_in_backward needs the whole model, its outermost FullyShardedDataParallel unit")
    context = units[0].context
    if context.gradient_consumer is not None:
        raise RuntimeError("step_in_backward is already entered for this model")
    handles = [handle for unit in units for handle in unit.handles]
    if any(handle.param_dtype == torch.float16 for handle in handles):
        raise ValueError("step_in_backward cannot train in fp16: its loss scaling would have to skip steps already "
                         "taken inside backward; compute in bf16 (MixedPrecision(param_dtype=torch.bfloat16))")
    if on_host_thread is None:
        on_host_thread = any(handle.copies_to_device for handle in handles)
    stepper = HandleSteps(optimizer, handles, on_host_thread)
    context.gradient_consumer = stepper
    try:
        yield
    finally:
        context.gradient_consumer = None
        stepper.close()
    if stepper.backwards == 0:
        raise RuntimeError("no synchronised backward ran inside step_in_backward, so the optimizer did not step: "
                           "call loss.backward() inside it (outside no_sync())")


class HandleSteps:
    """Steps `optimizer` on one handle's sharded views at a time, inline or on a thread of its own.

    Args:
        optimizer: over sharded views of `handles` only (frozen or unoptimised ones may be left out).
        handles: every handle of the model, in the end-of-backward order.
        on_host_thread: whether steps run on a worker thread (joined at the end of backward).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, handles: list[FlatParamHandle], on_host_thread: bool):
        if isinstance(optimizer, torch.optim.LBFGS):
            raise TypeError("step_in_backward steps one handle at a time; LBFGS needs every gradient and a "
                            "closure at once: call optimizer.step(closure) after backward instead")
        self.optimizer = optimizer
        self._views = {handle: {id(view) for view in handle.sharded_views} for handle in handles}
        ours = set().union(*self._views.values())
        foreign = [index for index, group in enumerate(optimizer.param_groups)
                   for param in group["params"] if id(param) not in ours]
        if foreign:
            raise ValueError(f"the optimizer holds {len(foreign)} tensors that are not this model's sharded "
                             f"parameters (param groups {sorted(set(foreign))}); build it over model.parameters() "
                             "after wrapping")
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="fsdp_mpi_step") if on_host_thread else None
        self._running: list[Future] = []
        self._stepped: set[FlatParamHandle] = set()  # in this backward
        self.backwards = 0  # synchronised backwards that stepped

    def gradient_reduced(self, handle: FlatParamHandle) -> None:
        """A reduction made `handle`'s gradient final, if this rank used all of its parameters: step it now."""
        if all(handle.gradient.received):
            self._step(handle)

    def backward_reduced(self, handles: list[FlatParamHandle]) -> None:
        """The end of a synchronised backward: steps what was left to it, then clears the gradients that the
        thread stepped with (inline, each is cleared as soon as its handle steps)."""
        self._wait()
        for handle in handles:
            if handle not in self._stepped and any(view.grad is not None for view in handle.sharded_views):
                self._step(handle)
        self._wait()
        for handle in self._stepped:
            _clear_gradient(handle)
        self._stepped.clear()
        self.backwards += 1

    def close(self) -> None:
        """Waits for steps still running (an exception left backward midway), then ends the thread."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)

    def _step(self, handle: FlatParamHandle) -> None:
        self._stepped.add(handle)
        if self._thread is None:
            self._step_handle(handle)
            _clear_gradient(handle)  # its memory is free for the rest of backward
        else:
            self._running.append(self._thread.submit(self._step_handle, handle))

    def _wait(self) -> None:
        """Joins the steps on the thread; one that failed raises here, in backward's thread."""
        running, self._running = self._running, []
        for future in running:
            future.result()

    def _step_handle(self, handle: FlatParamHandle) -> None:
        """Steps `handle`'s views once its gradient has come home (on the thread, the thread waits for it)."""
        handle.gradient.wait_for_arrival()
        self._step_views(self._views[handle])

    def _step_views(self, views: set[int]) -> None:
        """``optimizer.step()`` with each param group cut down to the parameters in `views` (ids)."""
        groups = self.optimizer.param_groups
        everything = [group["params"] for group in groups]
        try:
            for group, params in zip(groups, everything):
                group["params"] = [param for param in params if id(param) in views]
            self.optimizer.step()
        finally:
            for group, params in zip(groups, everything):
                group["params"] = params


def _clear_gradient(handle: FlatParamHandle) -> None:
    """``zero_grad(set_to_none=True)`` for one handle: its views' ``.grad`` and the reduced shard behind them."""
    for view in handle.sharded_views:
        view.grad = None
    handle.gradient.release_cleared_by_user()

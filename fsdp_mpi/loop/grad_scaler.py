"""Loss scaling for fp16 training on sharded gradients: one skip decision for all ranks.

fp16 gradients underflow unless the loss is scaled up before backward; a scale
that is too large overflows instead, and that step must be skipped. With
sharded gradients each rank sees only its shard, so an inf in rank 2's shard is
invisible to rank 0: the scaler reduces one found-inf flag over the ranks
(a max of 0 or 1), and every rank then skips, or steps, together. The scale then
shrinks after an overflow and grows after ``growth_interval`` clean steps, as in
``torch.amp.GradScaler``, whose call sequence this follows::

    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)        # optional: before clipping
    clip_grad_norm_(model, 1.0)
    scaler.step(optimizer)            # skipped on every rank if any rank found inf or NaN
    scaler.update()
"""

import torch

from fsdp_mpi.communication.comm import Communicator


class ShardedGradScaler:
    """Scales the loss, unscales sharded gradients, and skips a step on every rank or none.

    Args:
        comm: an mpi4py communicator or a ``fsdp_mpi.Communicator`` (the model's ranks; ``COMM_WORLD`` by default).
        init_scale, growth_factor, backoff_factor, growth_interval: as in ``torch.amp.GradScaler``.
        enabled: False makes every method a pass-through (for code shared with bf16/fp32 runs).
    """

    def __init__(self, comm=None, *, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000, enabled: bool = True):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1 and init_scale > 0):
            raise ValueError("need growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1, init_scale > 0")
        self.comm = comm if isinstance(comm, Communicator) else Communicator(comm)
        self.enabled = enabled
        self._scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self._clean_steps = 0  # steps since the last overflow or growth
        self._found_inf: bool | None = None  # this step's decision, once unscaled
        self.skipped_steps = 0  # steps skipped for overflow so far (the same on every rank)

    def get_scale(self) -> float:
        return self._scale if self.enabled else 1.0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self._scale if self.enabled else loss

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides this rank's gradients by the scale and agrees with the other ranks on whether any overflowed."""
        if not self.enabled:
            return
        if self._found_inf is not None:
            raise RuntimeError("unscale_() was already called since the last update()")
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        found_here = False
        if grads:
            torch._foreach_mul_(grads, 1.0 / self._scale)
            found_here = not bool(torch.stack([torch.isfinite(g).all() for g in grads]).all())
        self._found_inf = self.comm.all_reduce_max_float(float(found_here)) > 0

    @property
    def unscaled(self) -> bool:
        """Whether this step's gradients are unscaled, and the ranks agreed whether any overflowed (or scaling
        is off): nothing collective is left before ``step()``."""
        return not self.enabled or self._found_inf is not None

    def abandon_step(self) -> None:
        """Forgets this step's unscaling, for a step not taken (a lost rank abandoned it, its gradients dropped)."""
        self._found_inf = None

    def step(self, optimizer: torch.optim.Optimizer):
        """Unscales if needed, then steps unless some rank's gradients held inf or NaN; returns the step's result."""
        if not self.enabled:
            return optimizer.step()
        if self._found_inf is None:
            self.unscale_(optimizer)
        return None if self._found_inf else optimizer.step()

    def update(self) -> None:
        """Shrinks the scale after an overflow, grows it after ``growth_interval`` clean steps."""
        if not self.enabled:
            return
        if self._found_inf is None:
            raise RuntimeError("update() needs a step(): no gradients were unscaled since the last update()")
        if self._found_inf:
            self.skipped_steps += 1
            self._scale *= self.backoff_factor
            self._clean_steps = 0
        else:
            self._clean_steps += 1
            if self._clean_steps == self.growth_interval:
                self._scale *= self.growth_factor
                self._clean_steps = 0
        self._found_inf = None

    def state_dict(self) -> dict:
        return {"scale": self._scale, "clean_steps": self._clean_steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self._scale, self._clean_steps = float(state["scale"]), int(state["clean_steps"])
        self.skipped_steps = int(state.get("skipped_steps", 0))

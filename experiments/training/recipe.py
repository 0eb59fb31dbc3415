"""The optimisation recipe every strategy trains with, so that their comparison stays fair.

AdamW with decoupled weight decay on weight matrices and embeddings only (biases
and normalisation layers are left undecayed: the usual split for transformers), and
a learning rate that rises linearly over the warm-up, then follows a cosine down
to ``FINAL_LR_FRACTION`` of its peak at the run's last optimizer step. Every
strategy, Lightning's and ``bench.py``'s included, builds its AdamW with ``adamw``:
the same implementation for all, the fastest the device has.
"""

import math
from functools import partial

import torch
from torch import nn

WARMUP_FRACTION = 0.1  # the default warm-up: this share of the run's optimizer steps
FINAL_LR_FRACTION = 0.1  # the learning rate at the last step, as a share of --lr


def is_normalization(module: nn.Module) -> bool:
    """LayerNorm and its relatives (RMSNorm, GroupNorm, BatchNorm, a model's own ``...Norm`` class)."""
    return isinstance(module, nn.LayerNorm) or "Norm" in type(module).__name__


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW's two groups: [decayed weights and embeddings, undecayed biases and normalisation parameters].

    The group follows from the owning module's type and the parameter's attribute
    name, never from its shape: under fsdp-mpi every parameter the optimizer sees
    is a 1-D view of this rank's shard (possibly empty), registered under the
    original name on the original module. A tied parameter is listed once.
    """
    decay, no_decay, seen = [], [], set()
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            (no_decay if "bias" in name or is_normalization(module) else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# torch's fused AdamW kernel runs on the CPU from 2.4 on. There, on one thread, it steps 50M parameters in 300
# tensors in 0.38x the time of torch's default (a loop over tensors) and foreach takes 2.5x (docs/performance.md).
FUSED_ON_CPU = torch.__version__ >= "2.4"


def adamw(params, fused: bool = True, **options) -> torch.optim.AdamW:
    """AdamW over `params` (tensors or parameter groups) in the fastest form their device has: ``fused=True``
    (one kernel for all tensors) on a GPU, and on the CPU where torch has it (the optimizer of offloaded
    shards), unless `fused` is False; torch's default elsewhere. `options` go to AdamW (lr, weight_decay, ...)."""
    params = list(params)
    tensors = [p for group in params for p in (group["params"] if isinstance(group, dict) else [group])]
    devices = {p.device.type for p in tensors}
    fusable = bool(tensors) and devices <= ({"cuda", "cpu"} if FUSED_ON_CPU else {"cuda"})
    return torch.optim.AdamW(params, fused=True if fusable and fused else None, **options)


def lr_factor(step: int, total_steps: int, warmup_steps: int) -> float:
    """The multiple of the peak learning rate used by optimizer step `step` (counted from 0).

    Warm-up: (step + 1) / warmup_steps, reaching 1 at step warmup_steps - 1. Then a
    cosine from 1 at step warmup_steps to FINAL_LR_FRACTION at step total_steps - 1.
    """
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min((step - warmup_steps) / max(total_steps - 1 - warmup_steps, 1), 1.0)
    return FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress))


def optimizer_and_schedule(model: nn.Module, total_steps: int, lr: float, weight_decay: float,
                           warmup_steps: int | None, fused: bool = True):
    """(AdamW, LambdaLR) for `model`: peak `lr`, `weight_decay` on weights, `warmup_steps` (None: a tenth);
    `fused` as `adamw`'s.

    Step the schedule once after every optimizer step. `total_steps` counts the
    optimizer steps of the whole run (all epochs).
    """
    optimizer = adamw(parameter_groups(model, weight_decay), fused=fused, lr=lr)
    warmup = int(total_steps * WARMUP_FRACTION) if warmup_steps is None else warmup_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(lr_factor, total_steps=total_steps, warmup_steps=warmup))
    return optimizer, schedule

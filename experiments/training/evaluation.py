"""Validation, the same for our loop, Lightning's runner and ``eval.py``: sums over each rank's batches, added up
over the ranks."""

from contextlib import nullcontext

import numpy
import torch

from training.sampling import Batching, epoch_steps

from fsdp_mpi import Communicator


def to_device(batch, device: torch.device):
    return tuple(t.to(device) for t in batch)


@torch.no_grad()
def evaluate(task, model, batch_size: int, val_steps: int, seed: int, comm: Communicator, device: torch.device,
             autocast=nullcontext) -> dict:
    """The validation columns, from `val_steps` batches per rank (0: all; the same ones every epoch), under `autocast`.

    `seed` is the run's: the validation order is drawn from seed + 1.
    """
    model.eval()
    totals: dict[str, float] = {}
    batching = Batching(batch_size, grad_accum=1, steps_per_epoch=val_steps)
    for (micro,) in epoch_steps(len(task.val), batching, comm, epoch=0, seed=seed + 1):
        with autocast():
            sums = task.eval_sums(model, to_device(task.val.batch(micro.indices, 0), device))
        for key, value in sums.items():
            totals[key] = totals.get(key, 0.0) + (value if micro.weight else 0.0)
    model.train()
    keys = sorted(totals)
    summed = numpy.array([totals[k] for k in keys], dtype=numpy.float64)
    comm.all_reduce_sum_(torch.from_numpy(summed))  # element-wise, in place (the tensor shares summed's memory)
    return task.val_columns(dict(zip(keys, summed.tolist())))

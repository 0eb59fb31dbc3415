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
             autocast=nullcontext, started_on: int = 0) -> dict:
    """The validation columns, from `val_steps` batches of `batch_size` per rank the run started on (`started_on`,
    0: these; all batches if 0; the same ones every epoch, on any number of ranks), under `autocast`.

    `seed` is the run's: the validation order is drawn from seed + 1.
    """
    model.eval()
    totals: dict[str, float] = {}
    batching = Batching(batch_size, grad_accum=1, steps_per_epoch=val_steps, started_on=started_on)
    micro_batches = [micro for step in epoch_steps(len(task.val), batching, comm, epoch=0, seed=seed + 1)
                     for micro in step]
    for micro in micro_batches:
        with autocast():
            sums = task.eval_sums(model, to_device(task.val.batch(micro.indices, 0), device))
        for key, value in sums.items():
            totals[key] = totals.get(key, 0.0) + (value if micro.weight else 0.0)
    model.train()
    keys = sorted(totals)
    summed = numpy.array([totals[k] for k in keys], dtype=numpy.float64)
    comm.all_reduce_sum_(torch.from_numpy(summed))  # element-wise, in place (the tensor shares summed's memory)
    return task.val_columns(dict(zip(keys, summed.tolist())))

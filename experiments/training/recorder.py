"""The CSV rows a training run writes: one per epoch, and one per optimizer step (its loss curve).

Both our training loop (``loop``) and Lightning's runner hand each epoch's
``EpochTally`` to one ``RunRecorder``; the columns are ``results.COLUMNS`` and
``results.STEP_COLUMNS``.
"""

import math
import uuid
from datetime import datetime, timezone
from pathlib import Path

import numpy
import torch

from training.options import RunConfig
from training.results import STEP_COLUMNS, CsvWriter, git_commit, job_peak_flops, peak_rss_mb
from training.resume import EpochTally
from training.sampling import Batching

from fsdp_mpi import Communicator


class RunRecorder:
    """Turns one epoch's tally into its CSV row and its steps' rows (rank 0 writes), and keeps them for checkpoints.

    ``<out dir>/<run id>.csv`` gets a row per epoch, ``<run id>-steps.csv`` a row per optimizer step.
    """

    def __init__(self, task, config: RunConfig, comm: Communicator, device: torch.device, experiment: str, model,
                 batching: Batching):
        """`batching`: the run's, whose global batch (the ranks it started on) the rows record."""
        self.comm, self.task, self.config = comm, task, config
        world = comm.world_size
        global_batch = batching.global_batch(world)
        self.run_id = config.run_id or f"{experiment}-{config.strategy}-n{world}-{uuid.uuid4().hex[:6]}"
        task_flops = getattr(task, "training_flops_per_token", None)  # a task that skips some of the model's work
        self.flops_per_token = task_flops(model) if task_flops else model.training_flops_per_token(task.seq_len)
        comm.barrier()
        self.peak_flops = job_peak_flops(comm, device, config.precision)  # as bench.py's MFU
        self.fixed = {
            "run_id": self.run_id, "experiment": experiment, "strategy": config.strategy, "model": task.model_name,
            "parameters": model.num_parameters(), "world_size": world, "threads_per_rank": config.threads,
            "device": device.type, "precision": config.precision, "comm_compression": config.comm_compression,
            "cpu_offload": config.cpu_offload, "step_in_backward": config.step_in_backward,
            "global_batch": global_batch,
            "grad_accum": math.ceil(global_batch / (batching.batch_size * world)),  # micro-batches a step, here
            "seq_len": task.seq_len, "git_commit": git_commit(),
        }
        self.rows: list[dict] = []
        self.step_rows: list[dict] = []
        self.writers = None  # rank 0's (epochs, steps), opened at the first row: a resumed run takes its run id before

    def add_epoch(self, epoch: int, first_step: int, tally: EpochTally, val: dict, state_bytes: int,
                  device: torch.device) -> None:
        """Every rank calls it after validating; rank 0 prints the epoch's line and writes its rows.

        `first_step`: the run's optimizer steps before this epoch. `tally.comm_seconds` is NaN where unmeasured.
        """
        step_loss_sums = numpy.array(tally.step_loss_sums, dtype=numpy.float64)  # (steps,) every rank's
        samples, seconds = sum(tally.step_samples), tally.seconds
        train_loss = float(step_loss_sums.sum()) / samples  # a Python float: rows go into checkpoints
        # On a GPU, torch's peak plus the node transport's slots, which torch's allocator does not see.
        peak_memory = (torch.cuda.max_memory_allocated(device) + self.comm.device_bytes_outside_torch()
                       if device.type == "cuda" else None)
        per_rank = self.comm.all_gather_object([peak_rss_mb(), state_bytes / 2**20, (peak_memory or 0) / 2**20,
                                               tally.comm_seconds])
        maxima = [max(column) for column in zip(*per_rank)]  # the busiest rank
        tokens_per_s = samples * self.task.seq_len / seconds
        achieved = tokens_per_s * self.flops_per_token
        row = {
            **self.fixed, "epoch": epoch, "steps": tally.steps, "epoch_time_s": round(seconds, 4),
            "samples_per_s": round(samples / seconds, 3), "tokens_per_s": round(tokens_per_s, 1),
            "tflops": round(achieved / 1e12, 6), "mfu": round(achieved / self.peak_flops, 5),
            "train_loss": round(train_loss, 5), **val,
            "peak_memory_mb": round(maxima[2] if device.type == "cuda" else maxima[0], 1),
            "peak_rss_mb": round(maxima[0], 1), "model_state_mb": round(maxima[1], 3),
            "comm_time_s": "" if math.isnan(maxima[3]) else round(maxima[3], 4),
            "comm_mb_per_step": round(tally.comm_bytes / tally.steps / 2**20, 4) if tally.comm_bytes else "",
            "compute_time_s": "" if math.isnan(maxima[3]) else round(seconds - maxima[3], 4),
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        step_rows = [{name: row[name] for name in STEP_COLUMNS if name in self.fixed}
                     | {"world_size": ranks, "epoch": epoch, "step": first_step + index + 1, "samples": count,
                        "train_loss": round(loss / count, 5)}
                     for index, (loss, count, ranks) in enumerate(zip(step_loss_sums.tolist(), tally.step_samples,
                                                                      tally.step_ranks))]
        if self.comm.rank == 0:
            print(f"epoch {epoch}: train loss {train_loss:.4f}, " + ", ".join(f"{k} {v}" for k, v in val.items())
                  + f", {seconds:.1f} s", flush=True)
            epochs_csv, steps_csv = self._writers()
            epochs_csv.add(row)
            for step_row in step_rows:
                steps_csv.add(step_row)
        self.rows.append(row)
        self.step_rows += step_rows

    def resume(self, run_id: str, rows: list[dict], step_rows: list[dict]) -> None:
        """Continues a stopped run's CSVs: its run id, and its rows so far ahead of the new ones."""
        self.run_id = self.fixed["run_id"] = run_id
        self.rows, self.step_rows = list(rows), list(step_rows)

    def finish(self) -> Path | None:
        """Completes both CSVs (rank 0) and returns the epochs' one's path."""
        if self.comm.rank != 0:
            return None
        epochs_csv, steps_csv = self._writers()
        steps_csv.finish()
        return epochs_csv.finish()

    def _writers(self) -> tuple[CsvWriter, CsvWriter]:
        if self.writers is None:
            out_dir = Path(self.config.out_dir)
            self.writers = (CsvWriter(out_dir / f"{self.run_id}.csv"),
                            CsvWriter(out_dir / f"{self.run_id}-steps.csv", STEP_COLUMNS))
            for writer, rows in zip(self.writers, (self.rows, self.step_rows)):
                for row in rows:
                    writer.add(row)
        return self.writers

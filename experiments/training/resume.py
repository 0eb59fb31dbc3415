"""Stopping a training run between optimizer steps, and continuing it later, on as many ranks bit for bit or on
another number of them at the same sample (fsdp-mpi only).

``--checkpoint-dir DIR`` is a ``fsdp_mpi.files.checkpoint_directory.CheckpointDirectory``: one checkpoint
per saved step, and ``latest`` naming the newest complete one, so that a job killed at any moment leaves
``latest`` naming a complete checkpoint.

Besides the model's and AdamW's shards, a checkpoint holds everything else that the
rest of the run depends on: the position (epoch, steps done in it and in the run), the learning-rate
schedule, the loss scaler, each rank's running sums for the epoch's CSV row, the rows
so far and the run id, and the options that determine the numbers. The data order
needs nothing more: each epoch's order is a permutation seeded by (seed, epoch),
cut into global batches fixed by the ranks the run started on (sampling.py), so the
steps done in the epoch say which samples come next on any number of ranks; dropout
draws each sample's masks from (seed, step, sample) (fsdp_mpi.use_sample_dropout), the same
on any number of ranks; and anything else random in a step draws from generators seeded
by (seed, step, rank). On M ranks a
checkpoint saved on N is resharded as it loads (fsdp_mpi.load_checkpoint), the
epoch's running sums go to rank 0, and the global batch stays N's: each step takes
as many micro-batches as its samples need. Checkpoints are taken only between
optimizer steps, never inside gradient accumulation.

SIGTERM and SIGUSR1 (which SLURM can send ahead of a time limit: hpc/) only set a
flag (``fsdp_mpi.loop.stop_signals``). After every optimizer step the ranks take the maximum of their flags, so a
signal that reached only some ranks stops all of them after the same step; the run then exits with
STOPPED_WITH_CHECKPOINT (3: run again with --resume; hpc/ requeues).
"""

from dataclasses import asdict, dataclass, field
from pathlib import Path

from fsdp_mpi import STOPPED_WITH_CHECKPOINT, load_checkpoint
from fsdp_mpi.files.checkpoint_directory import LATEST, CheckpointDirectory

STOPPED_WITHOUT_CHECKPOINT = 4  # stopped by a signal without --checkpoint-dir: there is nothing to resume from
FORMAT = 4  # of the run state below; 2: per-step losses; 3: global batches, per-step seeds; 4: each step's loss
# summed over the ranks, on every rank. Others: refused
# Options a resumed run may change: where files go and how fast it runs, not what it computes.
MAY_CHANGE_ON_RESUME = frozenset({"checkpoint_dir", "checkpoint_every", "resume", "out_dir", "save_dir",
                                  "no_progress", "threads", "device", "data_dir", "no_download", "keep_going",
                                  "grow_back", "add_hosts", "sharding_strategy", "step_in_backward"})  # the last: the same steps either way


class ResumeError(Exception):
    """A checkpoint that this run cannot continue from (other options, or more ranks than its global batch has
    samples)."""


@dataclass
class EpochTally:
    """One epoch's training so far on this rank, as its CSV rows sum it; carried across a stop and resume."""

    step_loss_sums: list[float] = field(default_factory=list)  # per optimizer step: its per-sample losses, all ranks'
    # (the same on every rank: a run that loses ranks keeps those of the steps done)
    step_samples: list[int] = field(default_factory=list)  # per optimizer step: its samples over all ranks
    step_ranks: list[int] = field(default_factory=list)  # per optimizer step: the ranks that trained it
    seconds: float = 0.0  # in training steps: start-up, validation and checkpoint saves excluded
    comm_seconds: float = 0.0  # this rank's time blocked in communication within those
    comm_bytes: int = 0  # this rank's bytes moved by collectives within those

    def add_step(self, loss_sum: float, samples: int, ranks: int) -> None:
        self.step_loss_sums.append(loss_sum)
        self.step_samples.append(samples)
        self.step_ranks.append(ranks)

    @property
    def steps(self) -> int:
        """Optimizer steps of the epoch done."""
        return len(self.step_samples)


@dataclass
class Position:
    """How far training has come: `step` optimizer steps of the whole run, in epoch `epoch`."""

    step: int = 0
    epoch: int = 0
    tally: EpochTally = field(default_factory=EpochTally)


@dataclass
class Stopped:
    """A run that a signal stopped after optimizer step `step`, with its checkpoint if it saved one."""

    signal_name: str
    step: int
    total_steps: int
    checkpoint: Path | None

    @property
    def exit_code(self) -> int:
        return STOPPED_WITH_CHECKPOINT if self.checkpoint else STOPPED_WITHOUT_CHECKPOINT

    def message(self) -> str:
        stopped = f"stopped by {self.signal_name} after optimizer step {self.step} of {self.total_steps}"
        if self.checkpoint:
            return (f"{stopped}; checkpoint in {self.checkpoint}: run the same command with --resume to continue "
                    f"(exit code {self.exit_code})")
        return f"{stopped}, without a checkpoint (no --checkpoint-dir): it cannot continue (exit code {self.exit_code})"


def determining_options(config) -> dict:
    """The options (a RunConfig's fields) that a resumed run must share with the one that saved."""
    return {name: value for name, value in sorted(config.as_dict().items()) if name not in MAY_CHANGE_ON_RESUME}


class RunCheckpoints:
    """Saves one fsdp-mpi run's whole training state into --checkpoint-dir, and restores it under --resume."""

    def __init__(self, run):
        """`run`: training.Run, the model, optimizer, schedule and CSV recorder being trained, with the options."""
        self.run = run
        self.directory = CheckpointDirectory(run.config.checkpoint_dir, run.comm)

    def due(self, step: int) -> bool:
        """Whether --checkpoint-every asks for a checkpoint after `step` (the run's end saves one anyway)."""
        every = self.run.config.checkpoint_every
        return every > 0 and step % every == 0 and step < self.run.total_steps

    def save(self, position: Position) -> Path:
        return self.directory.save(position.step, self.run.prepared.model, self.run.optimizer, self._extra(position),
                                   self.run.batching.started_on)

    def _extra(self, position: Position) -> dict:
        """What the run depends on besides model, optimizer and random generators. Rank 0's copy is written,
        so the per-rank running sums are gathered into it."""
        run = self.run
        return {
            "format": FORMAT, "step": position.step, "epoch": position.epoch,
            "tallies": run.comm.all_gather_object(asdict(position.tally)),
            "schedule": run.schedule.state_dict(), "scaler": run.prepared.scaler.state_dict(),
            "run_id": run.recorder.run_id, "rows": run.recorder.rows, "step_rows": run.recorder.step_rows,
            "options": determining_options(run.config), "world_size": run.comm.world_size,
        }

    def restore(self) -> Position:
        """Loads `latest` into the model, optimizer, schedule, scaler and CSV rows; a fresh start if there is none.

        Call it last before training: it sets the random generators to where they were when saved.
        """
        directory = self.directory.latest()
        if directory is None:
            self._announce(f"--resume: no checkpoint in {self.directory.root} yet; starting fresh")
            return Position()
        run = self.run
        extra = load_checkpoint(directory, run.prepared.model, run.optimizer)
        self._check_same_run(directory, extra)
        run.schedule.load_state_dict(extra["schedule"])
        run.prepared.scaler.load_state_dict(extra["scaler"])
        run.recorder.resume(extra["run_id"], extra["rows"], extra["step_rows"])
        saved_on = extra["world_size"]
        ranks = "" if saved_on == run.comm.world_size else f" (saved on {saved_on} ranks, now {run.comm.world_size})"
        self._announce(f"resuming from {directory}: epoch {extra['epoch']}, after optimizer step {extra['step']} "
                       f"of {run.total_steps}{ranks}")
        return Position(extra["step"], extra["epoch"], self._tally(extra["tallies"]))

    def _tally(self, saved: list[dict]) -> EpochTally:
        """This rank's part of the epoch's running sums: its own on as many ranks, else the saving rank 0's (the
        loss sums are every rank's, the times rank 0's)."""
        comm = self.run.comm
        return EpochTally(**saved[comm.rank if len(saved) == comm.world_size else 0])

    def _announce(self, line: str) -> None:
        if self.run.comm.rank == 0:
            print(line, flush=True)

    def _check_same_run(self, directory: Path, extra: dict) -> None:
        """Refuses to continue a checkpoint whose run differs from this one (the same on every rank)."""
        if extra.get("format") != FORMAT:
            raise ResumeError(f"{directory} was saved by another version of the experiments (run state format "
                              f"{extra.get('format', 1)}, this version reads {FORMAT}); start afresh with another "
                              "--checkpoint-dir")
        saved, ours = extra["options"], determining_options(self.run.config)
        changed = [f"--{name.replace('_', '-')} {saved.get(name)!r} (now {ours.get(name)!r})"
                   for name in sorted(set(saved) | set(ours)) if saved.get(name) != ours.get(name)]
        if changed:
            raise ResumeError(f"{directory} was saved by a run with other options: " + ", ".join(changed)
                              + "; resume with the same ones, or start afresh with another --checkpoint-dir")

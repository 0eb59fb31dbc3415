"""Lightning's SLURM auto-requeue under ``FSDPMPIStrategy``: after an optimizer step, the same one on every rank.

Under SLURM a Lightning run requeues its job ahead of the time limit. Its ``SLURMEnvironment`` (the Trainer's
plugin, or the one Lightning finds by itself in a batch job) names the signal: SIGUSR1 unless told, which
``#SBATCH --signal=USR1@90`` sends. Lightning's handler then saves ``hpc_ckpt_N.ckpt`` in the Trainer's root
folder, rank 0 calls ``scontrol requeue``, and the requeued job resumes from that file by itself.

That handler saves wherever the signal lands. A sharded save gathers every unit, so a rank whose signal came
inside a forward would gather while another still computes: a hang, or a file that mixes two steps. The
strategy's ranks are its communicator's (``CommEnvironment``), so Lightning installs no requeue handler for it.
This callback does the same work safely:

- the signal only notes itself (``StopSignals``);
- at the end of each optimizer step the ranks agree whether any of them noted it (one scalar reduction);
- if one did, every rank saves after that step, rank 0 requeues, and the run ends with ``STOPPED_WITH_CHECKPOINT``.

It saves where the requeued job resumes: Lightning's ``hpc_ckpt_N.ckpt``, or under ``fit_elastic`` that loop's own
checkpoint directory (``FSDPMPIStrategy.requeue_saves``), which the next ``fit_elastic`` resumes from.

As in Lightning, a signal that something else already handles (a user's handler, the experiments') is left to it.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import SLURMEnvironment

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.loop.stop_signals import STOPPED_WITH_CHECKPOINT, StopSignals


def requeue_signal(trainer) -> signal.Signals | None:
    """The signal on which the run asks to be requeued: the Trainer's SLURMEnvironment plugin's (kept by Lightning's
    connector before the strategy's environment replaced it), else, in a batch job that Lightning would take for
    one (``SLURMEnvironment.detect()``), its default, SIGUSR1. None where auto-requeue is off, or where the signal
    already has a handler."""
    given = trainer._accelerator_connector._cluster_environment_flag
    if isinstance(given, SLURMEnvironment):
        number = given.requeue_signal if given.auto_requeue else None
    else:  # read, not built: building one checks srun's variables, which mpiexec's ranks need not have
        number = signal.SIGUSR1 if SLURMEnvironment.detect() else None
    return number if number is not None and signal.getsignal(number) in (None, signal.SIG_DFL) else None


class RequeueAfterTheStep(Callback):
    """Saves, requeues and ends the run after the first optimizer step whose end finds the requeue signal noted on
    some rank. The strategy adds it as training starts (``added_to``) and ``close``s it at teardown."""

    def __init__(self, comm: Communicator, number: signal.Signals, callbacks: list, save: Callable[..., Path]):
        self.comm, self.callbacks, self.save = comm, callbacks, save
        self.stop = StopSignals((number,)).install()
        callbacks.append(self)

    @classmethod
    def added_to(cls, trainer, comm: Communicator,
                 save: Callable[..., Path] | None = None) -> "RequeueAfterTheStep | None":
        """The callback, among `trainer`'s, where the run asks for auto-requeue (``requeue_signal``). `save`: how
        the Trainer is saved where the requeued job resumes (collective; the path saved): Lightning's
        ``hpc_ckpt_N.ckpt`` by default, ``fit_elastic``'s checkpoint directory under it."""
        number = requeue_signal(trainer)
        return None if number is None else cls(comm, number, trainer.callbacks, save or save_for_lightnings_resume)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if pl_module.automatic_optimization and trainer.fit_loop.epoch_loop._should_accumulate():
            return  # a micro-batch before the step's last: the step has not ended
        received = self.stop.agreed(self.comm.all_reduce_max_float)
        if received is None:
            return
        path = self.save(trainer)
        if self.comm.rank == 0:
            print(f"fsdp_mpi.lightning: {received.name} after optimizer step {trainer.global_step}: saved {path}; "
                  f"{requeue()} (exit code {STOPPED_WITH_CHECKPOINT})", file=sys.stderr, flush=True)
        sys.exit(STOPPED_WITH_CHECKPOINT)

    def close(self) -> None:
        """The signal handled as before, and the callback out of the Trainer's."""
        self.stop.uninstall()
        self.callbacks.remove(self)


def save_for_lightnings_resume(trainer) -> Path:
    """``hpc_ckpt_N.ckpt`` in the Trainer's root folder, which a Trainer of the requeued job resumes from by itself."""
    path = Path(trainer._checkpoint_connector.hpc_save_path(trainer.default_root_dir))
    trainer.save_checkpoint(path)
    return path


def requeue() -> str:
    """Requeues this SLURM job as Lightning does (``scontrol requeue``, an array task by its own id), and says
    what came of it."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}" if array_job else os.environ.get("SLURM_JOB_ID")
    if not job:
        return "not a SLURM job, so nothing is requeued: run it again to resume from that file"
    try:
        done = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        failure = (done.stderr.strip() or f"exit {done.returncode}") if done.returncode else None
    except FileNotFoundError:
        failure = "scontrol not found"
    if failure:
        return (f"could not requeue job {job} ({failure}; #SBATCH --requeue allows it): submit the job again, and "
                "it resumes from that file")
    return f"requeued job {job}, which resumes from that file"

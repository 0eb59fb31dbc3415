"""Stopping a run between optimizer steps when the scheduler says its time is up, on every rank after the same step.

SLURM warns a job ahead of its time limit with the signal ``#SBATCH --signal=USR1@90`` names, and sends SIGTERM
at the limit, or when the job is requeued or cancelled. A signal reaches the ranks unevenly, and at any point of
a step: inside a collective as often as not. A handler that saved a checkpoint where the signal landed would
save one rank's half-updated shards while another waits in an all-gather. Here a signal only notes itself. After
each optimizer step every rank calls ``agreed``, which takes the highest signal noted over the ranks (one scalar
reduction). So a signal that reached one rank stops all of them after the same step, where a checkpoint is whole:

    stop = StopSignals().install()
    for step in range(first_step, steps):
        ...                                  # forward, backward, optimizer.step()
        if stop.agreed(comm.all_reduce_max_float):
            save_checkpoint(model, optimizer, f"checkpoints/step-{step}")
            sys.exit(STOPPED_WITH_CHECKPOINT)   # hpc/resumable.sh requeues the job on this exit code

The experiments' loop and the Lightning strategy's requeue (``fsdp_mpi.lightning``) stop this way.
"""

import signal
from typing import Callable

STOPPED_WITH_CHECKPOINT = 3  # the exit code of a run stopped by a signal after saving: run it again to resume


class StopSignals:
    """Notes `signals` (SIGTERM and SIGUSR1 by default) on this rank; ``agreed`` after every optimizer step says
    whether any rank noted one."""

    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)):
        self.signals = tuple(signal.Signals(number) for number in signals)
        self.received = 0  # the last signal's number, 0 if none
        self._before: dict[signal.Signals, object] = {}

    def install(self) -> "StopSignals":
        """Handles the signals from now on (in the main thread, as Python allows); ``uninstall`` puts back what
        handled them before."""
        for number in self.signals:
            self._before[number] = signal.signal(number, self._note)
        return self

    def uninstall(self) -> None:
        for number, handler in self._before.items():
            signal.signal(number, handler)
        self._before.clear()

    def _note(self, number: int, _frame) -> None:
        self.received = number

    def agreed(self, all_reduce_max: Callable[[float], float]) -> signal.Signals | None:
        """The signal that some rank noted (the highest-numbered), or None: collective, every rank calls it after
        each optimizer step, with the maximum of a number over the ranks (``Communicator.all_reduce_max_float``).

        Once the ranks agree to stop, later signals are ignored: the first rank to exit with
        ``STOPPED_WITH_CHECKPOINT`` makes srun (``--kill-on-bad-exit``) send SIGTERM to the others, and a rank that
        is finalizing by then has no handler left (Python restores the default, death, as it finalizes; an
        ignored signal stays ignored), so the launcher's exit code would say killed, not stopped.
        """
        number = int(all_reduce_max(float(self.received)))
        if not number:
            return None
        for stop_signal in self.signals:
            signal.signal(stop_signal, signal.SIG_IGN)
        return signal.Signals(number)

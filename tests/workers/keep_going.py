"""experiments/run_gpt2.py with ranks killed at chosen moments, for tests/test_keep_going.py.

    python keep_going.py [--memory] [--hosts-after STEP:HOST:SLOTS] --kill RANK:STEP:MOMENT [--kill ...] --
        <run_gpt2.py's options>

RANK is the rank in the job (a newcomer that takes its place kills nothing), STEP the optimizer step (counted from 0 over the whole run),
MOMENT one of forward (the third unit hook of the step's forward), backward (the second of its backward),
reduce_scatter (as the step's first gradient reduce-scatter starts: the other ranks are inside it), rebuild
(as the survivors of a loss in that step start building the model again), validation (as the validation after
the epoch that ends with that step starts: the others are in its collectives) or reload (as the survivors of a
loss in that step start reading the latest checkpoint: the others are in its collectives). One more MOMENT does not kill:
damage (as the survivors of a loss in that step start building the model again, the rank truncates every file of
the latest checkpoint, which they are about to reload). The rank
sends itself SIGKILL: no handler, no MPI call, nothing flushed, as when a node dies. Every rank prints when
each optimizer step is done and when it is killed (wall clock), from which experiments/keep_going_bench.sh
takes the time from a failure to the next completed step, and whether the run before the loss is still alive
at the first step after the recovery (it must be gone without waiting for a collection). With --memory each
survivor also prints the peak memory of its process (held, and resident: ``ResidentPeaks``) in the training steps before the loss and during
the recovery (from the loss to the next completed step), beside the training state it held (parameters, gradients, optimizer state), for
experiments/bench_keep_going.py --memory. With --hosts-after the run's rank 0 writes HOST:SLOTS into run_gpt2.py's
--add-hosts file once optimizer step STEP is done, as a user adding a host while the run goes on.
"""

import faulthandler
import os
import signal
import sys
import threading
import time
import weakref
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[2] / "experiments"))

import run_gpt2  # noqa: E402
from training import loop, resume  # noqa: E402
from training.results import model_state_bytes  # noqa: E402
from training.run import main  # noqa: E402

from fsdp_mpi.communication import timing_points  # noqa: E402
from fsdp_mpi.communication.failures.job import is_newcomer, job_rank  # noqa: E402


class Killer:
    """A timing-points listener that kills this rank at its planned (step, moment)."""

    def __init__(self, plan: set[tuple[int, str]]):
        self.plan, self.step, self.seen = plan, -1, Counter()

    def enter(self, point: str) -> None:
        if point == timing_points.HOOK:  # autograd runs backward's hooks with gradients off
            self.reached("forward" if torch.is_grad_enabled() else "backward", 3 if torch.is_grad_enabled() else 2)

    def leave(self, point: str) -> None:
        pass

    def collective_started(self, record) -> None:
        if record.operation == "reduce_scatter":
            self.reached("reduce_scatter", 1)

    def reached(self, moment: str, nth: int) -> None:
        self.seen[self.step, moment] += 1
        if (self.step, moment) in self.plan and self.seen[self.step, moment] == nth:
            print(f"rank {job_rank()}: killed in step {self.step}'s {moment} at {time.time():.3f}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


class ResidentPeaks:
    """The peak memory of this process in each phase (the steps before the loss, its recovery: from the loss to
    the run rebuilt, the steps after), sampled by a thread every millisecond: its resident size, and the part of
    it the process holds itself (anonymous and shared memory, RssAnon + RssShmem), without the pages of files it
    maps (torch's libraries, the checkpoint it reads), which the kernel can drop and read again."""

    PHASES = ("before", "recovery", "after")

    def __init__(self):
        self.phase, self.state_bytes = "before", {}
        self.peaks = {kind: dict.fromkeys(self.PHASES, 0) for kind in ("held", "resident")}
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            with open("/proc/self/status") as status:
                kib = {name: int(value.split()[0]) for name, value in
                       (line.split(":", 1) for line in status if line.startswith("Rss"))}
            sizes = {"resident": (kib["RssAnon"] + kib["RssFile"] + kib["RssShmem"]) * 1024,
                     "held": (kib["RssAnon"] + kib["RssShmem"]) * 1024}
            for kind, size in sizes.items():
                self.peaks[kind][self.phase] = max(self.peaks[kind][self.phase], size)
            time.sleep(0.001)

    def report(self) -> None:
        """One line: each phase's peaks (held, resident) and the training state before and after, in MiB."""
        phases = "; ".join(f"{phase} {self.peaks['held'][phase] / 2**20:.1f} held, "
                           f"{self.peaks['resident'][phase] / 2**20:.1f} resident" for phase in self.PHASES)
        print(f"rank {job_rank()}: peak MiB {phases}; training state before "
              f"{self.state_bytes.get('before', 0) / 2**20:.1f}, after {self.state_bytes.get('after', 0) / 2**20:.1f}", flush=True)


def damage_latest_checkpoint(directory: Path) -> None:
    latest = directory / (directory / "latest").read_text().strip()
    for path in latest.iterdir():
        path.write_bytes(path.read_bytes()[:10])
    print(f"rank {job_rank()}: damaged {latest}", flush=True)


def install(kills: list[str], memory: bool, hosts_after: str | None) -> None:
    rank = job_rank()  # a newcomer (--grow-back) joins the job here, and kills nothing
    plan = set()
    for kill in kills:
        victim, step, moment = kill.split(":")
        if int(victim) == rank and not is_newcomer():
            plan.add((int(step), moment))
    killer = Killer(plan)
    timing_points.add_listener(killer)
    counted = loop.optimizer_step

    peaks = ResidentPeaks() if memory else None

    before_the_loss: list = []  # a weak reference to the model of the run before the last loss

    def optimizer_step(run, step, position):
        killer.step = position.step
        if before_the_loss:  # the first step after a recovery: the old run must be gone without a collection
            print(f"rank {rank}: the run before the loss alive at the next step: {before_the_loss.pop()() is not None}",
                  flush=True)
        done = counted(run, step, position)
        if hosts_after and position.step == int(hosts_after.split(":")[0]) and run.comm.rank == 0:
            Path(run.config.add_hosts).write_text(hosts_after.split(":", 1)[1] + "\n")
        print(f"rank {rank}: step {position.step} done at {time.time():.3f}", flush=True)  # for the benchmark
        if peaks and peaks.phase in ("before", "after"):
            peaks.state_bytes[peaks.phase] = model_state_bytes(run.prepared.model, run.optimizer)
        if peaks:
            peaks.report()  # a rank's last line holds every step
        return done
    loop.optimizer_step = optimizer_step
    go_on = loop.go_on_without_the_lost

    def going_on(*args):
        if peaks:
            peaks.phase = "recovery"
        before_the_loss[:] = [weakref.ref(args[0].prepared.model)]
        survived = go_on(*args)
        if peaks:
            peaks.phase = "after"
        return survived
    loop.go_on_without_the_lost = going_on
    build = loop.start_run

    def start_run(task, config, *args):
        killer.reached("rebuild", 1)  # the run's first build comes before step 0
        if (killer.step, "damage") in plan:
            damage_latest_checkpoint(Path(config.checkpoint_dir))
        return build(task, config, *args)
    loop.start_run = start_run
    evaluate, load_checkpoint = loop.evaluate, resume.load_checkpoint

    def validating(*args, **kwargs):
        killer.reached("validation", 1)
        return evaluate(*args, **kwargs)

    def reloading(*args, **kwargs):
        killer.reached("reload", 1)
        return load_checkpoint(*args, **kwargs)
    loop.evaluate, resume.load_checkpoint = validating, reloading


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR2, all_threads=True)  # a hung test dumps every rank's threads on SIGUSR2
    separator = sys.argv.index("--")
    ours, sys.argv = sys.argv[1:separator], [sys.argv[0], *sys.argv[separator + 1:]]
    install([ours[index + 1] for index, word in enumerate(ours) if word == "--kill"], "--memory" in ours,
            ours[ours.index("--hosts-after") + 1] if "--hosts-after" in ours else None)
    sys.exit(main(run_gpt2.GPT2Task, run_gpt2.GPT2RunConfig, run_gpt2.parser(), "gpt2"))

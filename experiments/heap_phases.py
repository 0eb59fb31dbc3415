"""What a step's memory is, phase by phase: the bytes live in malloc's blocks against what the process has
resident, for fsdp-mpi or torch's FSDP2 on the same model, units and batch (run under mpiexec, once per strategy).

    mpiexec -n 2 python experiments/heap_phases.py --strategy fsdp-mpi --model gpt2-seed --batch-size 4 --seq-len 128
    mpiexec -n 2 python experiments/heap_phases.py --strategy torch-fsdp --model gpt2-seed --batch-size 4 --seq-len 128

Each strategy runs with the allocator as it ships (fsdp-mpi's arena and heap setting where fsdp-mpi is
constructed; glibc's defaults otherwise): no ``GLIBC_TUNABLES`` here. Rank 0 prints, for every step, its peak
resident size (the kernel's high-water mark, restarted at the step's start), the size of malloc's heaps and
mapped blocks at its end, and the arena's most bytes in use at once and bytes touched (fsdp-mpi: its tensors of
64 KiB and more; sharding/host_allocator.py); then for the last step, at each phase (read in hooks on the first,
middle and last blocks): the bytes in use (``mallinfo2``: heap blocks in use plus mapped blocks, plus the arena's
in use), the heap's free bytes, the mapped blocks, and the resident size now and at most so far in the step. A
peak far above the bytes in use is memory the allocator keeps and does not use: free heap that stays resident.
"""

import argparse
import ctypes
import ctypes.util
import json

import torch
from measuring import bench_models
from training.recipe import adamw
from training.results import peak_resident_bytes, reset_peak_resident, resident_bytes
from training.strategies import prepare

from fsdp_mpi import Communicator, abort_job_on_uncaught_exception
from fsdp_mpi.sharding import host_allocator

MB = 2**20


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc 2.33 and later): every arena's totals."""
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                       "fsmblks", "uordblks", "fordblks", "keepcost")]


def heap_reader():
    """A function that returns (bytes in use, free heap bytes, mapped bytes), or None without glibc's mallinfo2."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = MallInfo2

    def read() -> tuple[int, int, int]:
        info = libc.mallinfo2()
        return info.uordblks + info.hblkhd, info.fordblks, info.hblkhd
    return read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=("fsdp-mpi", "torch-fsdp"), default="fsdp-mpi")
    parser.add_argument("--model", default="gpt2-seed", choices=bench_models.NAMES)
    parser.add_argument("--batch-size", type=int, default=4, help="per rank")
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", help="where rank 0 writes the figures as JSON")
    args = parser.parse_args()
    abort_job_on_uncaught_exception()
    read_heap = heap_reader()
    if read_heap is None:
        parser.error("needs glibc's mallinfo2 (glibc 2.33 or later)")
    comm = Communicator()
    torch.manual_seed(0)
    model = bench_models.build(args.model)
    block = bench_models.unit_class(model)
    net = prepare(args.strategy, model, block, torch.device("cpu"), comm).model
    phases: list[dict] = []

    def phase(name: str) -> None:
        in_use, free, mapped = read_heap()
        in_use += host_allocator.counters()["in_use_bytes"]
        phases.append({"phase": name, "in_use_mb": in_use / MB, "heap_free_mb": free / MB, "mapped_mb": mapped / MB,
                       "resident_mb": resident_bytes() / MB, "step_peak_mb": peak_resident_bytes() / MB})

    blocks = [module for module in net.modules() if isinstance(module, block)]
    blocks[0].register_forward_pre_hook(lambda *_: phase("forward: the first block starts"))
    blocks[-1].register_forward_hook(lambda *_: phase("forward: the last block ends"))
    blocks[-1].register_full_backward_pre_hook(lambda *_: phase("backward: the last block starts (logits done)"))
    blocks[len(blocks) // 2].register_full_backward_hook(lambda *_: phase("backward: the middle block ends"))
    blocks[0].register_full_backward_hook(lambda *_: phase("backward: the first block ends"))
    optimizer = adamw(net.parameters(), lr=1e-4)
    batch = bench_models.synthetic_batch(model, args.batch_size, args.seq_len, comm.rank, torch.device("cpu"))
    steps = []
    for step in range(args.steps):
        phases.clear()
        reset_peak_resident()
        phase("step starts")
        loss = net(*batch)[-1]
        phase("forward ends (logits, loss)")
        loss.backward()
        phase("backward ends")
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        phase("optimizer step ends")
        in_use, free, mapped = read_heap()
        arena = host_allocator.counters()
        steps.append({"step": step, "step_peak_mb": peak_resident_bytes() / MB,
                      "heap_and_mapped_mb": (in_use + free) / MB,
                      "arena_most_in_use_mb": arena["most_in_use_bytes"] / MB,
                      "arena_touched_mb": arena["touched_bytes"] / MB})
    if comm.rank == 0:
        print(f"{args.strategy}, {args.model}, {comm.world_size} ranks, {args.batch_size} x {args.seq_len} a rank "
              "(rank 0; MB)")
        print("step  peak resident  heap + mapped at its end  arena: most in use  touched")
        for row in steps:
            print(f"{row['step']:4d}  {row['step_peak_mb']:13.0f}  {row['heap_and_mapped_mb']:24.0f}  "
                  f"{row['arena_most_in_use_mb']:18.0f}  {row['arena_touched_mb']:7.0f}")
        print(f"the last step, phase by phase:\n{'phase':48s} {'in use':>7s} {'heap free':>9s} {'mapped':>7s} "
              f"{'resident':>8s} {'peak so far':>11s}")
        for row in phases:
            print(f"{row['phase']:48s} {row['in_use_mb']:7.0f} {row['heap_free_mb']:9.0f} {row['mapped_mb']:7.0f} "
                  f"{row['resident_mb']:8.0f} {row['step_peak_mb']:11.0f}")
        if args.out:
            with open(args.out, "w") as out:
                json.dump({"strategy": args.strategy, "model": args.model, "ranks": comm.world_size,
                           "batch_size": args.batch_size, "seq_len": args.seq_len, "steps": steps,
                           "last_step": phases}, out, indent=1)


if __name__ == "__main__":
    main()

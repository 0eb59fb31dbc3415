"""What the cost model is fed: one rank's computation profile (measured here, or computed from FLOPs for
hardware that is not here) and timings of fsdp-mpi's collectives. predict.py runs these as its ``profile``
and ``time-comm`` commands; ``costmodel`` prices a step from them.
"""

import json
import statistics
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

from measuring.costmodel import ADAM_STATE_BYTES_PER_PARAMETER, MeasuredNetwork, Profile, Unit

from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config


class PredictError(Exception):
    """Input the predictor cannot use; main() prints it and exits 2."""


# ------------------------------------------------------------------ profile: one rank, measured


@contextmanager
def saved_tensor_bytes(excluded_storages: set):
    """Counts the bytes of the tensors autograd saves for backward inside the block (each storage once, those
    in `excluded_storages` aside: weights); yields a one-element list that holds the count afterwards."""
    import torch

    saved, counted = {}, [0]

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage._cdata not in excluded_storages:
            saved[storage._cdata] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield counted
    counted[0] = sum(saved.values())


def saved_activation_bytes(model, inputs, targets) -> int:
    """Bytes of the tensors autograd keeps for backward after one forward (each storage once, weights excluded)."""
    with saved_tensor_bytes({p.untyped_storage()._cdata for p in model.parameters()}) as counted:
        _, loss = model(inputs, targets)  # the graph, and so every saved storage, lives until loss goes
    return counted[0]


def wait_for_every_rank(world) -> None:
    """A barrier whose waiting ranks sleep: one that busy-polled, as MPI's does, would take the cores from the
    ranks still computing the phase and lengthen it by time no job spends."""
    arrived = world.Ibarrier()
    while not arrived.Test():
        time.sleep(0.0005)


def measure_profile(args) -> Profile:
    """One rank's step, unit by unit: fsdp-mpi wraps each GPT2Block, as ``bench_worker`` does.

    Under mpiexec every rank profiles a model of its own, with no communication
    between them, and the ranks start each phase of a step (forward, backward,
    optimizer) together, as a job's ranks do: the profile then sees the machine
    as loaded as the job will, its cores, memory bandwidth and caches shared by
    as many ranks. Every rank returns the median rank's profile.
    """
    import torch
    from mpi4py import MPI
    from training.recipe import adamw
    from training.results import peak_resident_bytes, resident_bytes
    from training.strategies import prepare

    from fsdp_mpi import Communicator

    world = MPI.COMM_WORLD
    comm = Communicator(MPI.COMM_SELF)  # this rank's model is its own
    baseline = resident_bytes()  # the interpreter, torch and MPI, before any model
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(gpt2_config(args.model, vocab_size=args.vocab_size, dropout=0.0))
    generator = torch.Generator().manual_seed(1234)
    tokens = torch.randint(args.vocab_size, (args.batch_size, args.seq_len + 1), generator=generator)
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    activations = saved_activation_bytes(model, inputs, targets)
    blocks = [m for m in model.modules() if isinstance(m, GPT2Block)]
    block_numels = [sum(p.numel() for p in block.parameters()) for block in blocks]
    parameters = sum(p.numel() for p in model.parameters())  # as stored and moved: the vocabulary's padding too
    root_numel = parameters - sum(block_numels)
    block_tensors = len(list(blocks[0].parameters()))
    root_tensors = len(list(model.parameters())) - len(blocks) * block_tensors

    block_seconds = time_each_forward(blocks)
    prepared = prepare("fsdp-mpi", model, GPT2Block, torch.device("cpu"), comm)
    optimizer = adamw(prepared.model.parameters(), lr=1e-4)
    forward, backward, optimizer_s, block_forward = timed_phases(prepared.model, optimizer, inputs, targets, args,
                                                                 world, block_seconds)
    backward_per_forward = backward / forward  # each unit's backward taken in the step's own proportion
    root_forward = max(forward - sum(block_forward), 0.0)
    units = [Unit("<root>", root_numel, root_forward, root_forward * backward_per_forward, is_root=True,
                  tensors=root_tensors)]
    units += [Unit(f"block.{i}", numel, seconds, seconds * backward_per_forward, tensors=block_tensors)
              for i, (numel, seconds) in enumerate(zip(block_numels, block_forward))]
    state = ADAM_STATE_BYTES_PER_PARAMETER * parameters  # on one rank
    transient = max(0, peak_resident_bytes() - baseline - state - activations)
    mine = Profile(units, optimizer_s, activations, args.batch_size * args.seq_len, baseline_bytes=baseline,
                   transient_bytes=transient)
    profiles = sorted(world.allgather(mine), key=lambda profile: profile.step_s)
    return profiles[len(profiles) // 2]  # the median rank's: the slowest is one rank's bad luck with the scheduler


def time_each_forward(blocks) -> list[float]:
    """Hooks on `blocks` that keep each one's last forward time, in seconds, in the list returned."""
    seconds = [0.0] * len(blocks)

    def time_forward(index: int, block) -> None:
        def start(*_):
            seconds[index] = -time.perf_counter()

        def stop(*_):
            seconds[index] += time.perf_counter()

        block.register_forward_pre_hook(start)
        block.register_forward_hook(stop)

    for index, block in enumerate(blocks):
        time_forward(index, block)
    return seconds


def timed_phases(model, optimizer, inputs, targets, args, world,
                 block_seconds: list[float]) -> tuple[float, float, float, list[float]]:
    """(forward, backward, the optimizer step, [each block's forward]): seconds, medians over the timed steps.
    Every rank of `world` starts each phase together; the peak resident memory restarts after the warm-up."""
    from training.results import reset_peak_resident

    steps = []  # (forward, backward, optimizer, [block forwards])
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            reset_peak_resident()  # the timed steps' peak: the model's construction aside
        times = []
        for phase in ("forward", "backward", "optimizer"):
            wait_for_every_rank(world)
            start = time.perf_counter()
            if phase == "forward":
                _, loss = model(inputs, targets)
            elif phase == "backward":
                loss.backward()
            else:
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - start)
        steps.append((*times, list(block_seconds)))
    steps = steps[args.warmup:]
    forward, backward, optimizer_s = (statistics.median(step[i] for step in steps) for i in range(3))
    return forward, backward, optimizer_s, [statistics.median(step[3][i] for step in steps)
                                            for i in range(len(block_seconds))]


def profile_from_flops(model_name: str, batch_size: int, seq_len: int, peak_flops: float, mfu: float,
                       memory_bytes_per_s: float) -> Profile:
    """A GPU's profile on paper: each unit's matmul FLOPs at `mfu` of `peak_flops`, backward twice forward, AdamW
    reading and writing 36 bytes per parameter at `memory_bytes_per_s`, activations in bf16 counted by a forward
    on the meta device (no memory used), and bf16 gathers with fp32 gradient reductions (bf16-mixed)."""
    import torch

    config = gpt2_config(model_name, dropout=0.0)  # no dropout masks saved, as in large pretraining runs
    with torch.device("meta"):
        model = GPT2LMHeadModel(config).to(torch.bfloat16)
        tokens = torch.zeros(batch_size, seq_len, dtype=torch.long)
    activations = saved_activation_bytes(model, tokens, tokens)
    tokens_per_step = batch_size * seq_len
    block_numel = sum(p.numel() for p in model.transformer.h[0].parameters())
    stored = sum(p.numel() for p in model.parameters())  # as stored and moved: the vocabulary's padding too
    root_numel = stored - config.n_layer * block_numel
    block_tensors = len(list(model.transformer.h[0].parameters()))
    root_tensors = len(list(model.parameters())) - config.n_layer * block_tensors

    def seconds(forward_flops_per_token):
        forward = forward_flops_per_token * tokens_per_step / (peak_flops * mfu)
        return forward, 2 * forward

    attention = 4 * seq_len * config.n_embd  # scores and weighted values, per token, forward
    units = [Unit("<root>", root_numel, *seconds(2 * config.n_embd * config.padded_vocab_size), is_root=True,
                  tensors=root_tensors)]
    units += [Unit(f"block.{i}", block_numel, *seconds(2 * block_numel + attention), tensors=block_tensors)
              for i in range(config.n_layer)]
    optimizer = 36 * stored / memory_bytes_per_s
    return Profile(units, optimizer, activations, tokens_per_step, param_bytes=2, grad_bytes=4)


def save_profile(profile: Profile, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(profile), indent=1))


def load_profile(path: Path) -> Profile:
    try:
        data = json.loads(Path(path).read_text())
        return Profile(**{**data, "units": [Unit(**unit) for unit in data["units"]]})
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise PredictError(f"{path} is not a profile written by 'predict.py profile': {error}") from None


# ------------------------------------------------------------------ time-comm: collectives, measured

SIZES = [2**k for k in range(14, 27, 2)] + [2**27]  # 16 KiB to 128 MiB


def time_collective(group, world, operation: str, nbytes: int, repeats: int) -> tuple[int, float]:
    """(bytes, seconds): the full buffer of about `nbytes` that splits evenly over the group, and the median
    over `repeats` of the slowest rank's time for one collective on it."""
    import torch

    shard = torch.ones(nbytes // 4 // group.world_size)
    full = torch.ones(shard.numel() * group.world_size)
    run = {"all_gather": lambda: group.all_gather_into(full, shard),
           "reduce_scatter": lambda: group.reduce_scatter_sum(shard, full),
           "all_reduce": lambda: group.all_reduce_sum_(full)}[operation]
    return full.numel() * 4, slowest_rank_seconds(run, world, repeats)


def slowest_rank_seconds(run, world, repeats: int) -> float:
    """The median over `repeats` calls of `run` of the slowest rank's time, after one untimed call
    (buffers touched, connections made); every rank of `world` (a ``Communicator``) calls this together."""
    run()
    times = []
    for _ in range(repeats):
        world.barrier()
        start = time.perf_counter()
        run()
        times.append(world.all_reduce_max_float(time.perf_counter() - start))
    return statistics.median(times)


def time_collectives(args, comm) -> dict:
    """Every (operation, group size) the strategies can use on the ranks of `comm` (a ``Communicator``):
    contiguous shard groups for all-gather and reduce-scatter, strided replica groups for all-reduce, all
    groups at once as in training."""
    ranks = comm.world_size
    sizes = [size for size in SIZES if size <= args.max_bytes]
    curves = []
    for group_size in [p for p in range(2, ranks + 1) if ranks % p == 0]:
        shard_group = comm if group_size == ranks else comm.split(comm.rank // group_size)
        replica_group = comm if group_size == ranks else comm.split(comm.rank % (ranks // group_size))
        for operation, group in (("all_gather", shard_group), ("reduce_scatter", shard_group),
                                 ("all_reduce", replica_group)):
            points = [time_collective(group, comm, operation, size, args.repeats) for size in sizes]
            curves.append({"operation": operation, "group": group_size, "points": points})
    return {"world": ranks, "curves": curves}


def load_network(path: Path) -> MeasuredNetwork:
    try:
        data = json.loads(Path(path).read_text())
        curves = {(c["operation"], data["world"], c["group"]): [tuple(point) for point in c["points"]]
                  for c in data["curves"]}
        return MeasuredNetwork(curves, data["world"])
    except (OSError, ValueError, TypeError, KeyError) as error:
        raise PredictError(f"{path} is not a timing written by 'predict.py time-comm': {error}") from None

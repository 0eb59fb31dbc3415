"""torch's own FSDP2, HSDP, DDP and DTensor on the "fsdp_mpi" backend (fsdp_mpi/distributed.py), against one
process, step by step at the same parameters (equivalence.py's check 1: the gradient within the derived bound
of one fp32 process's, both against a float64 one; the loss likewise).

    mpiexec -n N python torch_distributed.py OUT [--device cuda]

The program is one written for torch alone: only its start is fsdp_mpi's (``init_process_group()``). The model
is Hugging Face's GPT-2, one FSDP2 unit per block and the root, as torch's documentation wraps it.
"""

import copy
import itertools
import math
import sys
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
from common import gpt_batch, local_part, output_path, take_device_argument, write_json
from gradients import compare_gradients
from mpi4py import MPI
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

import fsdp_mpi.distributed
from fsdp_mpi import Communicator
from fsdp_mpi.distributed import MpiProcessGroup

STEPS = 3
VOCAB = 64


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0, loss_type="ForCausalLM")
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def loss_of(model, inputs, targets):
    logits = model(input_ids=inputs).logits.float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def full(tensor) -> torch.Tensor:
    """A parameter's or gradient's whole value: a DTensor's gathered, a plain tensor as it is."""
    return (tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor).detach().to("cpu", torch.float32)


def run(kind: str, device: torch.device) -> list[dict]:
    """`kind`: fsdp2, fsdp2_bf16, hsdp or ddp; each step's gradient and loss against one process."""
    rank, world = dist.get_rank(), dist.get_world_size()
    initial = gpt2()
    ours = copy.deepcopy(initial).to(device)
    bf16 = kind == "fsdp2_bf16"
    if kind == "ddp":
        ours = DistributedDataParallel(ours)
    else:
        mesh = (init_device_mesh(device.type, (world, 1), mesh_dim_names=("replicate", "shard")) if kind == "hsdp"
                else init_device_mesh(device.type, (world,)))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else \
            MixedPrecisionPolicy()
        for block in ours.transformer.h:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(ours, mesh=mesh, mp_policy=policy)
    optimizer = torch.optim.SGD(ours.parameters(), lr=0.1)
    u = (torch.finfo(torch.bfloat16) if bf16 else torch.finfo(torch.float32)).eps / 2
    checks = []
    for step in range(STEPS):
        inputs, targets = gpt_batch(step, VOCAB, global_batch=6, seq=16)
        # One process at our parameters: in the same policy (bf16 compute from the fp32 masters), and in float64.
        named = {name: full(p) for name, p in ours.named_parameters()}
        references = {}
        for dtype in (torch.bfloat16 if bf16 else torch.float32, torch.float64):
            reference = copy.deepcopy(initial).to(dtype)
            with torch.no_grad():
                for name, p in reference.named_parameters():
                    p.copy_(named[name] if name in named else named[f"module.{name}"])  # DDP's are the module's
            loss = loss_of(reference, inputs, targets)
            loss.backward()
            references[dtype] = (loss.item(), {name: p.grad.to(torch.float64 if dtype == torch.float64 else
                                                                torch.float32) for name, p in reference.named_parameters()})
        loss = loss_of(ours, local_part(inputs, rank, world).to(device), local_part(targets, rank, world).to(device))
        loss.backward()
        grads = {name.removeprefix("module."): full(p.grad) for name, p in ours.named_parameters()}
        (low, low_grads), (exact, exact_grads) = references.values()
        check = compare_gradients(grads, low_grads, exact_grads, world, u)
        global_loss = float(fsdp_mpi_mean(loss.detach()))
        check["loss_error"] = abs(global_loss - exact)
        check["loss_bound"] = 4 * max(abs(low - exact), 16 * u * abs(exact))
        checks.append(check)
        optimizer.step()
        optimizer.zero_grad()
    return checks


def fsdp_mpi_mean(value: torch.Tensor) -> torch.Tensor:
    """The mean over ranks, through the backend: an all-reduce with AVG."""
    value = value.clone()
    dist.all_reduce(value, op=dist.ReduceOp.AVG)
    return value


def collectives(device: torch.device) -> dict:
    """The calls beyond what FSDP2 and DDP make, each against its closed form."""
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    value = torch.tensor([float(rank + 1)], device=device)
    for op, expected in ((dist.ReduceOp.MAX, world), (dist.ReduceOp.MIN, 1), (dist.ReduceOp.PRODUCT,
                                                                            math.factorial(world))):
        reduced = value.clone()
        dist.all_reduce(reduced, op=op)
        results[f"all_reduce {op}"] = float(reduced) == expected
    work = dist.all_reduce(reduced := value.clone(), async_op=True)
    work.wait()
    results["all_reduce, async"] = float(reduced) == world * (world + 1) / 2
    gathered = [torch.empty(2, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.full((2,), float(rank), device=device))
    results["all_gather of a list"] = all(torch.equal(t, torch.full((2,), float(r), device=device))
                                          for r, t in enumerate(gathered))
    sent = torch.arange(world, dtype=torch.float32, device=device) + 10 * rank
    received = torch.empty(world, device=device)
    dist.all_to_all_single(received, sent)
    results["all_to_all_single"] = received.tolist() == [10.0 * r + rank for r in range(world)]
    tensor = torch.full((3,), float(rank), device=device)
    dist.broadcast(tensor, src=world - 1)
    results["broadcast from the last rank"] = tensor.tolist() == [float(world - 1)] * 3
    received_right = True
    if rank == 0:
        dist.send(torch.tensor([7.0, 8.0], device=device), dst=world - 1)
    elif rank == world - 1:
        got = torch.empty(2, device=device)
        dist.recv(got, src=0)
        received_right = got.tolist() == [7.0, 8.0]
    results["send and recv"] = received_right
    # A DTensor op: a matrix sharded by rows, summed.
    matrix = torch.arange(12.0, device=device).view(world * 2, -1)
    sharded = distribute_tensor(matrix, init_device_mesh(device.type, (world,)), [Shard(0)])
    results["DTensor sum of a row-sharded matrix"] = float(sharded.sum().full_tensor()) == float(matrix.sum())
    # Bound to a device, as init_process_group(device_id=...) binds it (Lightning does on a GPU): torch asks the
    # group for its backend on that device, to split it for a new group (here on any machine) or connect it ahead.
    bound = dist.group.WORLD.bound_device_id
    dist.group.WORLD.bound_device_id = torch.device("cuda", 0)
    try:
        summed = torch.ones(1, device=device)
        dist.all_reduce(summed, group=dist.new_group(list(range(world))))
        results["a new group of a group bound to a device"] = float(summed) == world
    except RuntimeError as error:
        print(f"a new group of a group bound to a device: {error}", file=sys.stderr)
        results["a new group of a group bound to a device"] = False
    dist.group.WORLD.bound_device_id = bound
    results.update(defects_of_the_review(device))
    return {name: all(dist_all(ok)) for name, ok in results.items()}


def defects_of_the_review(device: torch.device) -> dict:
    """What torch's test base and a review found wrong in the backend (issue 71), each against its closed form."""
    rank, world = dist.get_rank(), dist.get_world_size()
    left, right = (rank - 1) % world, (rank + 1) % world
    results = {}
    # Uneven all-to-all: rank r sends r + 1 elements to each rank and receives j + 1 from rank j.
    sent = torch.full(((rank + 1) * world,), float(rank), device=device)
    received = torch.empty(sum(j + 1 for j in range(world)), device=device)
    dist.all_to_all_single(received, sent, [j + 1 for j in range(world)], [rank + 1] * world)
    results["uneven all_to_all_single"] = received.tolist() == [float(j) for j in range(world) for _ in range(j + 1)]
    # Integer and bool sums (the direct and staged routes had none), an integer mean truncated, a 16-bit mean
    # whose sum is past float16's range (65504) but whose mean is not.
    counts = torch.tensor([3 * rank + 1, -(3 * rank + 1)], dtype=torch.int64, device=device)
    dist.all_reduce(summed := counts.clone())
    dist.all_reduce(averaged := counts.clone(), op=dist.ReduceOp.AVG)
    total = sum(3 * r + 1 for r in range(world))
    results["int64 sum and mean"] = summed.tolist() == [total, -total] and averaged.tolist() == [
        int(total / world), -int(total / world)]
    flags = torch.tensor([rank == 0, False], device=device)
    dist.all_reduce(flags)
    results["bool sum: or"] = flags.tolist() == [True, False]
    half = torch.full((4,), 40000.0, dtype=torch.float16, device=device)
    dist.all_reduce(half, op=dist.ReduceOp.AVG)
    results["float16 mean of a sum past its range"] = half.tolist() == [40000.0] * 4
    # all_gather_coalesced: a list per rank of every input, one of them empty.
    inputs = [torch.full((2,), float(rank), device=device), torch.empty(0, device=device),
              torch.full((3,), float(rank), device=device)]
    outputs = [[torch.empty_like(t) for t in inputs] for _ in range(world)]
    dist.all_gather_coalesced(outputs, inputs)
    results["all_gather_coalesced with an empty tensor"] = all(
        out[0].tolist() == [float(r)] * 2 and out[1].numel() == 0 and out[2].tolist() == [r] * 3
        for r, out in enumerate(outputs))
    # Messages: every rank receives before it sends (blocking calls would wait for each other forever), bf16.
    got = torch.empty(3, dtype=torch.bfloat16, device=device)
    receiving = dist.irecv(got, src=left)
    sending = dist.isend(torch.full((3,), float(rank), dtype=torch.bfloat16, device=device), dst=right)
    receiving.wait()
    sending.wait()
    results["irecv before isend on every rank, bf16"] = got.tolist() == [float(left)] * 3
    batch = [dist.P2POp(dist.irecv, got2 := torch.empty(2, device=device), left),
             dist.P2POp(dist.isend, torch.full((2,), rank + 0.5, device=device), right)]
    for request in dist.batch_isend_irecv(batch):
        request.wait()
    results["batch_isend_irecv around the ring"] = got2.tolist() == [left + 0.5] * 2
    senders = []
    if rank == 0:
        for _ in range(world - 1):
            payload = torch.empty(1, device=device)
            source = dist.recv(payload)  # from any rank
            senders.append((source, float(payload)))
    else:
        dist.send(torch.tensor([10.0 * rank], device=device), dst=0)
    results["recv from any rank names the sender"] = rank != 0 or sorted(senders) == [
        (r, 10.0 * r) for r in range(1, world)]
    # An error on the communication thread completes the work with it (it hung): a staged group, where a
    # started collective runs there, and an output one element too long.
    staged = MpiProcessGroup(Communicator(MPI.COMM_WORLD.Dup(), force_staging=True))
    work = staged._allgather_base(torch.empty(world * 2 + 1, device=device), torch.zeros(2, device=device))
    deadline = time.monotonic() + 4  # it completes in milliseconds; a mutant's hang waits this long
    while not work.is_completed() and time.monotonic() < deadline:
        time.sleep(0.01)
    completes = all(dist_all(work.is_completed()))  # else waiting for it, or for a later error, would hang
    results["an error on the communication thread completes the work"] = completes and (
        "fsdp_mpi: raised by all_gather" in raised_by(work.wait))
    # A message shorter than the tensor it is received into is an error, not a tensor left partly old.
    short, refused = torch.full((3,), -1.0, device=device), completes
    if completes and rank == 0:
        dist.send(torch.ones(2, device=device), dst=1)
    elif completes and rank == 1:
        refused = "received 8 bytes from rank 0 into a tensor of 12" in raised_by(lambda: dist.recv(short, src=0))
    results["a short message is refused"] = refused
    # Groups: a group of all ranks is an MPI communicator of its own, its timeout= the watchdog's limit; a
    # group split from the world (as a device mesh splits a group bound to a device) is MPI's split.
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=77))
    comms = [dist.group.WORLD.comm.mpi_comm, group.comm.mpi_comm, MPI.COMM_WORLD]
    results["no two groups share a communicator"] = all(
        MPI.Comm.Compare(a, b) == MPI.CONGRUENT for a, b in itertools.combinations(comms, 2))
    results["timeout= is the group's limit on a call"] = group.limit == 77  # FSDP_MPI_TIMEOUT is not set here
    halves = [list(range(world // 2)), list(range(world // 2, world))]
    mine = halves[rank >= world // 2]
    split = dist.group.WORLD.split_group(mine, group_name="half")
    one = torch.ones(1, device=device)
    split.allreduce([one]).wait()
    results["a group split from the world"] = split.group_name == "half" and float(one) == len(mine)
    return results


def raised_by(call) -> str:
    """What `call` raised, as Python prints it ("" if nothing)."""
    try:
        call()
    except Exception as error:  # noqa: BLE001
        return "".join(traceback.format_exception_only(error))
    return ""


def dist_all(ok: bool) -> list[bool]:
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(ok))
    return flags


if __name__ == "__main__":
    device = take_device_argument()
    # On a GPU bound to it, as Lightning binds it: a device mesh then splits the world (HSDP's 2-D mesh).
    fsdp_mpi.distributed.init_process_group(**({"device_id": device} if device.type == "cuda" else {}))
    report = {kind: run(kind, device) for kind in ("fsdp2", "fsdp2_bf16", "hsdp", "ddp")}
    report["collectives"] = collectives(device)
    report["backend"] = dist.get_backend()
    write_json(output_path(), report)
    dist.destroy_process_group()

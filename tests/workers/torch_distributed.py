"""torch's own FSDP2, HSDP, DDP and DTensor on the "fsdp_mpi" backend (fsdp_mpi/distributed.py), against one
process, step by step at the same parameters (equivalence.py's check 1: the gradient within the derived bound
of one fp32 process's, both against a float64 one; the loss likewise).

    mpiexec -n N python torch_distributed.py OUT [--device cuda]

The program is one written for torch alone: only its start is fsdp_mpi's (``init_process_group()``). The model
is Hugging Face's GPT-2, one FSDP2 unit per block and the root, as torch's documentation wraps it.
"""

import copy
import math
import sys

import torch
import torch.distributed as dist
from common import gpt_batch, local_part, output_path, take_device_argument, write_json
from gradients import compare_gradients
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

import fsdp_mpi.distributed

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
    dist.group.WORLD.bound_device_id = torch.device("cuda", 0)
    try:
        summed = torch.ones(1, device=device)
        dist.all_reduce(summed, group=dist.new_group(list(range(world))))
        results["a new group of a group bound to a device"] = float(summed) == world
    except RuntimeError as error:
        print(f"a new group of a group bound to a device: {error}", file=sys.stderr)
        results["a new group of a group bound to a device"] = False
    dist.group.WORLD.bound_device_id = None
    try:
        dist.all_to_all_single(torch.empty(world + 1, device=device), torch.zeros(world + 1, device=device),
                               [1] * (world - 1) + [2], [1] * (world - 1) + [2])
        results["uneven all_to_all refused"] = False
    except NotImplementedError as refused:
        results["uneven all_to_all refused"] = "uneven splits" in str(refused)
    return {name: all(dist_all(ok)) for name, ok in results.items()}


def dist_all(ok: bool) -> list[bool]:
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, bool(ok))
    return flags


if __name__ == "__main__":
    device = take_device_argument()
    fsdp_mpi.distributed.init_process_group()
    report = {kind: run(kind, device) for kind in ("fsdp2", "fsdp2_bf16", "hsdp", "ddp")}
    report["collectives"] = collectives(device)
    report["backend"] = dist.get_backend()
    write_json(output_path(), report)
    dist.destroy_process_group()

"""torch's clients of a process group over the "fsdp_mpi" backend, beside gloo: DTensor (1-D and 2-D meshes),
FSDP2 as its tutorials write it, and FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``) on the CPU.

    mpiexec -n N python torch_clients.py OUT FOLDER                 # then
    mpiexec -n N python torch_clients.py OUT2 FOLDER --continue

One job, two groups of the same ranks: the default group (fsdp_mpi, over a TCP store so that gloo can meet on it
too) and a gloo group. Every program runs once on each, the same seeds and batches, and the two are compared:

- data moved (DTensor's placements, every state dict loaded back): equal to the bit, and to its closed form;
- a step's gradient (a reduction of every rank's): equal to the bit where the sum's order cannot matter (2 ranks:
  a + b is b + a, and a division by 2 is exact); elsewhere within what two orders of summing the same n fp32
  terms can differ by, 2 (n - 1) u sum|g_i| / n with u = 2^-24 (the division by n a power of two: exact). The
  terms' magnitudes come from an unsharded replica of the model on each rank's part of the batch.

Within one backend, a training run continued from a full checkpoint in the second job (``--continue``) equals the
run that never stopped, to the bit.
"""

import copy
import socket
import sys
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import everywhere, output_path, same_state, write_json
from mpi4py import MPI
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
from torch.distributed.fsdp import MixedPrecisionPolicy, StateDictType, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import fsdp_mpi.distributed

FP32_U = 2.0 ** -24
WIDTH, INPUTS, OUTPUTS = 13, 7, 5  # uneven shards on 2, 3 and 4 ranks; an empty one on 4 (5 rows)
FULL_TO_ALL = StateDictOptions(full_state_dict=True)  # every rank gets the whole state
FULL_ON_0 = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 alone, as a checkpoint is written
FROM_RANK_0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def start() -> dict[str, dist.ProcessGroup]:
    """The default group on fsdp_mpi and a gloo group of the same ranks, met on one TCP store (rank 0's port)."""
    world = MPI.COMM_WORLD
    port = world.bcast(free_port() if world.Get_rank() == 0 else None)
    store = dist.TCPStore("127.0.0.1", port, world.Get_size(), world.Get_rank() == 0, timeout=timedelta(seconds=60))
    dist.init_process_group(fsdp_mpi.distributed.BACKEND, store=store, rank=world.Get_rank(),
                            world_size=world.Get_size())
    return {"fsdp_mpi": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# ----------------------------------------------------------------- DTensor

def dtensor(group: dist.ProcessGroup) -> dict[str, torch.Tensor]:
    """Each placement change of a (13, 7) tensor of whole numbers (every sum exact, in any order), on a 1-D mesh of
    `group` and on a 2-D mesh of its ranks (2 x n/2). Each value is checked against its closed form here; the
    report compares the two backends'."""
    mesh = DeviceMesh.from_group(group, "cpu")
    n, rank = group.size(), group.rank()
    whole = torch.arange(WIDTH * INPUTS, dtype=torch.float32).reshape(WIDTH, INPUTS)
    part = lambda dim: chunk_or_empty(whole, n, dim, rank)  # noqa: E731
    sharded = distribute_tensor(whole, mesh, [Shard(0)])
    partial = DTensor.from_local(whole * (rank + 1), mesh, [Partial()])
    cases = {
        "distribute Shard(0), full_tensor": (sharded.full_tensor(), whole),
        "Shard(0) to Replicate": (sharded.redistribute(mesh, [Replicate()]).to_local(), whole),
        "Shard(0) to Shard(1)": (sharded.redistribute(mesh, [Shard(1)]).to_local(), part(1)),
        "Replicate to Shard(0)": (distribute_tensor(whole, mesh, [Replicate()]).redistribute(mesh, [Shard(0)])
                                  .to_local(), part(0)),
        "Partial(sum) to Replicate": (partial.redistribute(mesh, [Replicate()]).to_local(),
                                      whole * (n * (n + 1) // 2)),
        "Partial(sum) to Shard(0)": (partial.redistribute(mesh, [Shard(0)]).to_local(),
                                     chunk_or_empty(whole * (n * (n + 1) // 2), n, 0, rank)),
        "Partial(max) to Replicate": (DTensor.from_local(whole * (rank + 1), mesh, [Partial("max")])
                                      .redistribute(mesh, [Replicate()]).to_local(), whole * n),
        "a matmul over Shard(1) and Shard(0), full_tensor": (
            (distribute_tensor(whole, mesh, [Shard(1)]) @ distribute_tensor(whole.T, mesh, [Shard(0)])).full_tensor(),
            whole @ whole.T),
    }
    if n % 2 == 0:
        grid = two_d_mesh(group)
        on_grid = distribute_tensor(whole, grid, [Shard(0), Shard(1)])
        grid_partial = DTensor.from_local(whole * (rank + 1), grid, [Partial(), Replicate()])
        cases |= {
            "2-D mesh: distribute (Shard(0), Shard(1)), full_tensor": (on_grid.full_tensor(), whole),
            "2-D mesh: to (Replicate, Shard(0))": (on_grid.redistribute(grid, [Replicate(), Shard(0)]).full_tensor(),
                                                    whole),
            "2-D mesh: (Partial, Replicate) to Replicate twice": (
                grid_partial.redistribute(grid, [Replicate(), Replicate()]).to_local(),
                # dim 0 sums a column: ranks equal mod n/2
                whole * sum(r + 1 for r in range(n) if r % (n // 2) == rank % (n // 2))),
        }
    for name, (got, expected) in cases.items():
        assert torch.equal(got, expected), f"{name}: {got} is not {expected}"
    return {name: got for name, (got, _) in cases.items()}


def chunk_or_empty(whole: torch.Tensor, n: int, dim: int, rank: int) -> torch.Tensor:
    """What ``Shard(dim)`` leaves on `rank` of `n`: torch.chunk's piece, or an empty one past the last."""
    pieces = whole.chunk(n, dim)
    return pieces[rank] if rank < len(pieces) else whole.narrow(dim, 0, 0)


def two_d_mesh(group: dist.ProcessGroup) -> DeviceMesh:
    """A 2 x n/2 mesh of `group`'s ranks on `group`'s backend: each rank's row and column groups."""
    n, backend = group.size(), dist.get_backend(group)
    layout = torch.arange(n).reshape(2, n // 2)
    down = [dist.new_group(column.tolist(), backend=backend) for column in layout.T]  # mesh dim 0: a column
    across = [dist.new_group(row.tolist(), backend=backend) for row in layout]  # mesh dim 1: a row
    rank = group.rank()
    return DeviceMesh.from_group([down[rank % (n // 2)], across[rank // (n // 2)]], "cpu", mesh=layout,
                                 mesh_dim_names=("down", "across"))


# ----------------------------------------------------------------- models, batches, bounds

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(INPUTS, WIDTH), nn.Linear(WIDTH, INPUTS)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(x)))


def model() -> nn.Sequential:
    return nn.Sequential(Block(), Block(), nn.Linear(INPUTS, OUTPUTS))


def batch(step: int, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's part of step `step`'s global batch (2 rows a rank)."""
    generator = torch.Generator().manual_seed(1000 + step)
    n, rank = group.size(), group.rank()
    x, y = torch.randn(2 * n, INPUTS, generator=generator), torch.randn(2 * n, OUTPUTS, generator=generator)
    return x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]


def loss_of(net: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(net(x).float(), y)


def sum_bound(full_state: dict[str, torch.Tensor], dtype: torch.dtype, x, y, group) -> dict[str, torch.Tensor]:
    """Per element, what two orders of summing the ranks' gradients can differ by, divided by n: the gradients
    of an unsharded replica holding `full_state` (its weights cast to `dtype`, as the sharded model computes) on
    this rank's batch, their magnitudes summed over the ranks."""
    replica = model()
    replica.load_state_dict(full_state)
    replica.to(dtype)
    loss_of(replica, x.to(dtype), y).backward()
    n = group.size()
    bounds = {}
    for name, parameter in replica.named_parameters():
        magnitude = parameter.grad.float().abs()
        dist.all_reduce(magnitude, group=group)
        bounds[name] = 2 * (n - 1) * FP32_U * magnitude / n
    return bounds


# ----------------------------------------------------------------- FSDP2, as its tutorials write it

def fsdp2_tutorial_model(group: dist.ProcessGroup, seed: int) -> nn.Module:
    """Built on the meta device, a unit per block and the root in bf16 compute with fp32 reductions, each block
    prefetching its neighbour's weights explicitly, then materialised (``to_empty``) and initialised
    (``reset_parameters``), as torch's FSDP2 tutorial does."""
    mesh = DeviceMesh.from_group(group, "cpu")
    with torch.device("meta"):
        net = model()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = [net[0], net[1]]
    for block in blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(net, mesh=mesh, mp_policy=policy)
    blocks[0].set_modules_to_forward_prefetch([blocks[1]])
    blocks[1].set_modules_to_backward_prefetch([blocks[0]])
    net.to_empty(device="cpu")
    torch.manual_seed(seed)
    for module in net.modules():
        if isinstance(module, nn.Linear):
            module.reset_parameters()
    return net


def fsdp2_step(net, optimizer, step: int, group) -> tuple[float, float]:
    """A step with clipping over the DTensor gradients: (loss, gradient norm before clipping)."""
    loss = loss_of(net, *batch(step, group))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(net.parameters(), max_norm=0.5)
    optimizer.step()
    optimizer.zero_grad()
    return loss.item(), float(norm.full_tensor() if isinstance(norm, DTensor) else norm)


def fsdp2_tutorial(group: dist.ProcessGroup, folder: Path) -> dict:
    """Five AdamW steps, and the first step's reduced gradient beside its bound. The same run is stopped after
    three steps and its full state written by rank 0 alone, for ``continued`` in the next job; the losses and
    weights the run ends with, beside it."""
    net = fsdp2_tutorial_model(group, seed=0)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    start_state = get_model_state_dict(net, options=FULL_TO_ALL)
    x, y = batch(0, group)
    loss_of(net, x, y).backward()
    first_gradient = {name: p.grad.full_tensor() for name, p in net.named_parameters()}
    bound = sum_bound(start_state, torch.bfloat16, x, y, group)
    optimizer.zero_grad()
    run = []
    for step in range(5):
        run.append(fsdp2_step(net, optimizer, step, group))
        if step == 2:  # written at once: a state dict may share tensors with the optimizer (its step count)
            save_on_0({"model": get_model_state_dict(net, options=FULL_ON_0),
                       "optimizer": get_optimizer_state_dict(net, optimizer, options=FULL_ON_0)},
                      checkpoint_file(folder, group, "after 3 steps"))
    final = get_model_state_dict(net, options=FULL_ON_0)
    save_on_0({"losses and norms": run[3:], "final": final}, checkpoint_file(folder, group, "the end"))
    return {"first gradient": first_gradient, "bound": bound, "steps": run, "final": final}


def continued(group: dist.ProcessGroup, folder: Path) -> bool:
    """The run ``fsdp2_tutorial`` stopped after three steps, in a new job: a model built afresh loads the full
    state from rank 0 alone (``broadcast_from_rank0``) and takes the last two steps. True if its losses,
    gradient norms and weights are those of the run that never stopped."""
    resumed = fsdp2_tutorial_model(group, seed=1)  # other weights: the load must bring every one
    optimizer = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
    on_0 = dist.get_rank() == 0
    saved = (torch.load(checkpoint_file(folder, group, "after 3 steps"), weights_only=True) if on_0
             else {"model": {}, "optimizer": {}})
    set_model_state_dict(resumed, saved["model"], options=FROM_RANK_0)
    set_optimizer_state_dict(resumed, optimizer, saved["optimizer"], options=FROM_RANK_0)
    steps = [fsdp2_step(resumed, optimizer, step, group) for step in (3, 4)]
    after = get_model_state_dict(resumed, options=FULL_ON_0)
    if on_0:
        end = torch.load(checkpoint_file(folder, group, "the end"), weights_only=True)
    return everywhere(not on_0 or (steps == end["losses and norms"] and same_state(after, end["final"])))


def checkpoint_file(folder: Path, group: dist.ProcessGroup, when: str) -> Path:
    return folder / f"fsdp2 tutorial on {dist.get_backend(group)}, {when}.pt"


def save_on_0(state: dict, path: Path) -> None:
    if dist.get_rank() == 0:
        torch.save(state, path)


# ----------------------------------------------------------------- FSDP1

def fsdp1(group: dist.ProcessGroup) -> dict:
    """torch's FSDP1 on the CPU (``device_id`` the CPU: its default asks for an accelerator), a unit per block and
    the root: three SGD steps and the first step's reduced gradient beside its bound (``use_orig_params``, which
    ``summon_full_params(with_grads=True)`` needs); then, with FSDP1's default flat parameters, each state-dict
    type (full, sharded, local) taken, the weights scrambled, and loaded back to the bit (torch loads a local
    state dict only into flat parameters)."""
    torch.manual_seed(0)
    plain = model()
    start_state = copy.deepcopy(plain.state_dict())
    net = TorchFSDP(plain, process_group=group, device_id=torch.device("cpu"),
                    auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    x, y = batch(0, group)
    loss_of(net, x, y).backward()
    with TorchFSDP.summon_full_params(net, with_grads=True):
        first_gradient = {unwrapped(name): p.grad.clone() for name, p in net.named_parameters()}
    bound = sum_bound(start_state, torch.float32, x, y, group)
    optimizer.zero_grad()
    losses = []
    for step in range(3):
        loss = loss_of(net, *batch(step, group))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    trained = full_weights(net)
    flat = TorchFSDP(model(), process_group=group, device_id=torch.device("cpu"),
                     auto_wrap_policy=ModuleWrapPolicy({Block}))
    before = full_weights(flat)
    loaded_back = {}
    for kind in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT, StateDictType.LOCAL_STATE_DICT):
        with TorchFSDP.state_dict_type(flat, kind):
            state = copy.deepcopy(flat.state_dict())
            with torch.no_grad():
                for parameter in flat.parameters():
                    parameter.add_(1.0)
            flat.load_state_dict(state)
        loaded_back[kind.name] = same_state(full_weights(flat), before)
    return {"first gradient": first_gradient, "bound": bound, "steps": losses, "final": trained,
            "state dicts loaded back": loaded_back}


def unwrapped(name: str) -> str:
    """A parameter's name in the plain model, FSDP1's wrapper modules left out."""
    return name.replace("_fsdp_wrapped_module.", "")


def full_weights(net) -> dict[str, torch.Tensor]:
    with TorchFSDP.summon_full_params(net):
        return {unwrapped(name): p.detach().clone() for name, p in net.named_parameters()}


# ----------------------------------------------------------------- the two backends compared

def within(ours: dict, gloo: dict, bound: dict, exact: bool) -> bool:
    """Each tensor of `ours` equal to `gloo`'s (`exact`), or within `bound` of it element by element."""
    if ours.keys() != gloo.keys():
        return False
    return all(torch.equal(ours[k], gloo[k]) if exact else bool(((ours[k] - gloo[k]).abs() <= bound[k]).all())
               for k in ours)


def report(groups: dict, folder: Path) -> dict:
    """Every program on each backend's group, and each check of the module's docstring: True where every rank
    found it so."""
    n = dist.get_world_size()
    exact = n == 2  # a sum of two is the same in either order; a division by 2 is exact
    dtensors = {name: dtensor(group) for name, group in groups.items()}
    tutorials = {name: fsdp2_tutorial(group, folder) for name, group in groups.items()}
    fsdp1s = {name: fsdp1(group) for name, group in groups.items()}
    ours, gloo = "fsdp_mpi", "gloo"
    result = {f"DTensor: {case}": torch.equal(got, dtensors[gloo][case]) for case, got in dtensors[ours].items()}
    for program, runs in (("FSDP2 tutorial", tutorials), ("FSDP1", fsdp1s)):
        result[f"{program}: first gradient as gloo's"] = within(runs[ours]["first gradient"],
                                                               runs[gloo]["first gradient"], runs[ours]["bound"],
                                                               exact)
        if exact:
            result[f"{program}: every step as gloo's, to the bit"] = (
                runs[ours]["steps"] == runs[gloo]["steps"] and same_state(runs[ours]["final"], runs[gloo]["final"]))
    for name in groups:
        for kind, ok in fsdp1s[name]["state dicts loaded back"].items():
            result[f"FSDP1: {kind} loaded back ({name})"] = ok
    flags = [None] * n
    dist.all_gather_object(flags, result)
    return {check: all(flag[check] for flag in flags) for check in result}


if __name__ == "__main__":
    groups = start()
    folder = Path(sys.argv[2])
    if sys.argv[3:] == ["--continue"]:
        outcome = {f"FSDP2 tutorial: continued in a second job as never stopped ({name})": continued(group, folder)
                   for name, group in groups.items()}
    else:
        folder.mkdir(exist_ok=True)
        outcome = report(groups, folder)
    write_json(output_path(), outcome)
    dist.barrier()
    dist.destroy_process_group()
    sys.exit(0)

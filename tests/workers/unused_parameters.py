"""Parameters that get no gradient in a step, on N ranks against one process (run under mpiexec).

One process leaves ``.grad`` None on a parameter that took no part in the loss, and
optimizers then leave it alone: no weight decay, no momentum. The model here has
every such case at once, decided by the step and by the data, so that ranks use
different parameters in the same step:

- ``branch``, a unit of its own, and ``side``, inside the root unit: used on even steps only;
- ``experts``, a unit: each sample goes to the expert its first feature picks (top-1
  routing by data); expert 2 only for a sample in rank 0's share, expert 3 never;
- ``rare_head``: only for flagged samples, all in the last rank's share;
- ``router``: computed every step but never reaches the loss.

Each step starts from the same parameters in both (ours are gathered and copied into
the reference), so only that step's gradients are compared:

1. which parameters have ``.grad`` None, per name, exactly as one process;
2. the others: ours against one fp32 process, both against float64, within
   4 x the fp32 process's own error plus the sharded sum's rounding, N u of the sum of
   the ranks' partial gradients' magnitudes;
3. after AdamW (weight decay, momentum), every parameter with no gradient is bit for
   bit what it was.

Modes: a backward per step with sync, two micro-batches under ``no_sync()`` (the branch
used in one of them on odd steps, so that only a step with no use anywhere drops the
gradient), and bf16 mixed precision (the None pattern and check 3 only). Compiled whole
(``torch.compile``, AOT autograd), where every rank must compile the same graph, on a model
whose use depends on the step only (``StaticBranchy``: no routing by data, no rank-only head):
the same checks with sync, compiling a function that calls the model (the root's unused layer
inside the graph); the same with one expert called as a part of its unit (gathered by eager
hooks: a break inside the root's graph), compiling the model itself (the root gathered outside
the graph: its parameters are the graph's inputs, none where unused);
with ``no_sync()``, where a compiled synced graph that does not run the branch must still
hand it what the earlier micro-batch gave it; and two such steps' gradients summed without
``zero_grad`` between them.
"""

import copy
from contextlib import nullcontext

import torch
from common import output_path, write_json
from torch import nn

from fsdp_mpi import Communicator, FullyShardedDataParallel, MixedPrecision, ModuleWrapPolicy, full_state_dict

FEATURES, PER_RANK, STEPS = 6, 4, 4
U = torch.finfo(torch.float32).eps / 2


class Experts(nn.Module):
    def __init__(self):
        super().__init__()
        self.linears = nn.ModuleList(nn.Linear(FEATURES, FEATURES) for _ in range(4))

    def forward(self, hidden, choice):
        mixed = torch.zeros_like(hidden)
        for index, expert in enumerate(self.linears):
            chosen = choice == index
            if chosen.any():
                mixed = mixed.index_put((chosen.nonzero().squeeze(1),), expert(hidden[chosen]))
        return mixed


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(FEATURES, FEATURES)
        self.branch = nn.Sequential(nn.Linear(FEATURES, FEATURES), nn.Tanh())
        self.side = nn.Linear(FEATURES, FEATURES)
        self.router = nn.Linear(FEATURES, 4)
        self.experts = Experts()
        self.rare_head = nn.Linear(FEATURES, 1)
        self.out = nn.Linear(FEATURES, 1)

    def forward(self, x, flagged, use_branch: bool):
        hidden = torch.tanh(self.trunk(x))
        if use_branch:
            hidden = hidden + self.branch(hidden) + self.side(hidden)
        self.router(hidden)  # computed, never used
        hidden = hidden + self.experts(hidden, x[:, 0].long())
        y = self.out(hidden).squeeze(1)
        if flagged.any():
            y = y + torch.where(flagged, self.rare_head(hidden).squeeze(1), torch.zeros_like(y))
        return y


class StaticBranchy(Branchy):
    """Branchy with no use that depends on data or rank; `with_part` adds one expert called as a part of its
    unit, which its eager hooks gather: a graph break inside the root's compiled forward."""

    def __init__(self, with_part: bool):
        super().__init__()
        self.with_part = with_part

    def forward(self, x, flagged, use_branch: bool):
        hidden = torch.tanh(self.trunk(x))
        if use_branch:
            hidden = hidden + self.branch(hidden) + self.side(hidden)
        self.router(hidden)  # computed, never used
        if self.with_part:
            hidden = hidden + self.experts.linears[0](hidden)
        return self.out(hidden).squeeze(1)


def global_batch(step: int, world: int):
    """x (B, F), flagged (B,), targets (B,); x[:, 0] is each sample's expert: 0 or 1, except one 2 in rank 0's share."""
    generator = torch.Generator().manual_seed(100 + step)
    size = PER_RANK * world
    x = torch.randn(size, FEATURES, generator=generator)
    x[:, 0] = torch.randint(0, 2, (size,), generator=generator).float()
    x[1, 0] = 2.0
    flagged = torch.zeros(size, dtype=torch.bool)
    flagged[-1] = step % 2 == 0
    return x, flagged, torch.randn(size, generator=generator)


def micro_batches(step: int, world: int, mode: str, rank: int | None = None) -> list[tuple]:
    """[(x, flagged, targets, use_branch)], one per micro-batch: `rank`'s share of each, or every rank's (None).

    no_sync mode splits each rank's share in two halves and uses the branch in the second half on
    step 0 and in the first on odd steps: only step 2 uses it nowhere.
    """
    x, flagged, targets = global_batch(step, world)
    if mode.endswith("no_sync"):
        parts = [(range(0, PER_RANK // 2), step % 2 == 1), (range(PER_RANK // 2, PER_RANK), step == 0)]
    else:
        parts = [(range(PER_RANK), step % 2 == 0)]
    ranks = range(world) if rank is None else [rank]
    batches = []
    for positions, use_branch in parts:
        index = torch.tensor([r * PER_RANK + p for r in ranks for p in positions])
        batches.append((x[index], flagged[index], targets[index], use_branch))
    return batches


def backward(model, step: int, world: int, mode: str, rank: int | None = None, call=None,
             device: torch.device | None = None) -> None:
    """One step's gradients of the mean loss over the global batch: from `rank`'s share (scaled by the
    rank count, since fsdp_mpi averages over ranks), or from all of it in one process (rank None).
    `call`: what computes the model's output (its compiled form), if not `model`; `device`: where the model
    computes, if not where its parameters are (offloaded)."""
    batches = micro_batches(step, world, mode, rank)
    scale = 1 if rank is None else world
    dtype = next(model.parameters()).dtype  # float64 for the exact reference
    for position, (x, flagged, targets, use_branch) in enumerate(batches):
        x, targets, flagged = x.to(device, dtype), targets.to(device, dtype), flagged.to(device)
        defer = hasattr(model, "no_sync") and position < len(batches) - 1
        with model.no_sync() if defer else nullcontext():  # forward too: compiled, it decides whether to reduce
            output = (model if call is None else call)(x, flagged, use_branch)
            ((output - targets).square().sum() / (PER_RANK * world) * scale).backward()


def partial_gradients_magnitude(reference64, step: int, world: int, mode: str) -> dict:
    """Per name: the sum over ranks of |each rank's float64 partial gradient|, what the sharded sum rounds."""
    total = {}
    for rank in range(world):
        reference64.zero_grad(set_to_none=True)
        backward(reference64, step, world, mode, rank)
        for name, param in reference64.named_parameters():
            if param.grad is not None:
                total[name] = total.get(name, 0) + param.grad.abs() / world
    return total


def run(comm: Communicator, mode: str) -> dict:
    world, rank = comm.world_size, comm.rank
    torch.manual_seed(0)
    compiled = mode.startswith("compiled")
    reference = StaticBranchy(with_part=mode == "compiled_part") if compiled else Branchy()
    precision = MixedPrecision(param_dtype=torch.bfloat16) if mode == "bf16" else None
    ours = FullyShardedDataParallel(copy.deepcopy(reference), comm=comm, mixed_precision=precision,
                                    auto_wrap_policy=ModuleWrapPolicy({nn.Sequential, Experts}))
    call = compile_afresh(ours, from_a_function=mode != "compiled_part") if compiled else ours
    optimizer = torch.optim.AdamW(ours.parameters(), lr=0.05, weight_decay=0.1)
    report = {"none_pattern_matches": [], "worst_gradient_ratio": 0.0, "untouched_when_no_gradient": [],
              "no_gradient_names": []}
    for step in range(STEPS):
        reference.load_state_dict(full_state_dict(ours, rank0_only=False))
        reference.zero_grad(set_to_none=True)
        backward(reference, step, world, mode)
        backward(ours, step, world, mode, rank, call)
        ours_grads = dict(ours.named_parameters())
        no_gradient = sorted(name for name, p in reference.named_parameters() if p.grad is None)
        ours_none = sorted(name for name, p in ours_grads.items() if p.grad is None)
        report["none_pattern_matches"].append(all(comm.all_gather_object(no_gradient == ours_none)))
        report["no_gradient_names"].append(no_gradient)
        report.setdefault("ours_no_gradient_names", []).append(ours_none)
        if mode != "bf16":
            reference64 = copy.deepcopy(reference).double()
            reference64.zero_grad(set_to_none=True)
            backward(reference64, step, world, mode)
            magnitude = partial_gradients_magnitude(copy.deepcopy(reference64), step, world, mode)
            for name, param in reference.named_parameters():
                if param.grad is None or ours_grads[name].grad is None:
                    continue
                exact = dict(reference64.named_parameters())[name].grad.reshape(-1)
                start, stop = _part_held(ours, name)
                ours_part = ours_grads[name].grad.double()
                error = (ours_part - exact[start:stop]).norm().item()
                own_error = (param.grad.double().reshape(-1) - exact).norm().item()
                bound = 4 * own_error + world * U * magnitude[name].reshape(-1).norm().item() + 1e-300
                report["worst_gradient_ratio"] = max(report["worst_gradient_ratio"], error / bound)
        before = {name: ours_grads[name].detach().clone() for name in no_gradient}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        report["untouched_when_no_gradient"].append(
            all(comm.all_gather_object(all(torch.equal(ours_grads[n].detach(), v) for n, v in before.items()))))
    report["worst_gradient_ratio"] = comm.all_reduce_max_float(report["worst_gradient_ratio"])
    return report


def compile_afresh(model, from_a_function: bool = True):
    """``torch.compile`` with AOT autograd, dynamo's caches emptied (each mode's model is new, and the
    recompilations for earlier ones would reach dynamo's limit, after which it runs the code eagerly): of a
    function that calls the model, so that the root is traced into the graph too, whose own unused parameters
    then test the graph's handing of None; or of the model itself (``torch.compile(model)``: the root gathers
    around the graph, eagerly, and its parameters take the eager path)."""
    torch._dynamo.reset()
    if from_a_function:
        return torch.compile(lambda *args: model(*args), backend="aot_eager")
    return torch.compile(model, backend="aot_eager")


def compiled_accumulation_across_steps(comm: Communicator) -> dict:
    """Compiled, two steps' gradients summed with no ``zero_grad`` between them (the branch's: in the first
    step's synced micro-batch, and in the second step's ``no_sync`` one only, so that an eager reduction adds
    to what a graph gave): ours against one process, both in float64, per parameter the error over its bound,
    the sharded sum's rounding (N u64 of the partial gradients' magnitudes)."""
    world, rank = comm.world_size, comm.rank
    torch.manual_seed(0)
    reference = StaticBranchy(with_part=False).double()
    ours = FullyShardedDataParallel(copy.deepcopy(reference), comm=comm,
                                    auto_wrap_policy=ModuleWrapPolicy({nn.Sequential, Experts}))
    call = compile_afresh(ours)
    magnitude = {}
    for step in (0, 1):
        for name, value in partial_gradients_magnitude(copy.deepcopy(reference), step, world, "no_sync").items():
            magnitude[name] = magnitude.get(name, 0) + value
        backward(reference, step, world, "no_sync")
        backward(ours, step, world, "no_sync", rank, call)
    worst, exact = 0.0, dict(reference.named_parameters())
    for name, param in ours.named_parameters():
        if (param.grad is None) != (exact[name].grad is None):
            return {"same_none_pattern": False}
        if param.grad is not None:
            start, stop = _part_held(ours, name)
            error = (param.grad - exact[name].grad.reshape(-1)[start:stop]).norm().item()
            bound = world * torch.finfo(torch.float64).eps / 2 * magnitude[name].norm().item() + 1e-300
            worst = max(worst, error / bound)
    return {"same_none_pattern": True, "worst_gradient_ratio": comm.all_reduce_max_float(worst)}


def _part_held(model, name: str) -> tuple[int, int]:
    """[start, stop) of the flattened parameter `name` that this rank's shard holds."""
    from fsdp_mpi.sharding.lifecycle import units_with_names

    for unit_name, unit in units_with_names(model):
        for handle in unit.handles:
            for slot in handle.slots:
                for use in slot.uses:
                    if ".".join(filter(None, (unit_name, use.name))) == name:
                        return handle.part_held(slot)
    raise KeyError(name)


def check_mode(mode: str, report: dict) -> dict:
    """Fails where a mode's None pattern differs from one process's, a parameter with no gradient moved, or a
    gradient is outside its bound: as the mode ends, so that a broken mode ends the job at once (the test
    checks which names had no gradient). Returns `report`."""
    assert report["none_pattern_matches"] == [True] * STEPS, (mode, report)
    assert report["untouched_when_no_gradient"] == [True] * STEPS, (mode, report)
    assert report["worst_gradient_ratio"] <= 1.0, (mode, report["worst_gradient_ratio"])
    return report


if __name__ == "__main__":
    communicator = Communicator()
    report = {mode: check_mode(mode, run(communicator, mode))
              for mode in ("sync", "no_sync", "bf16", "compiled", "compiled_part", "compiled_no_sync")}
    accumulation = compiled_accumulation_across_steps(communicator)
    assert accumulation["same_none_pattern"] and accumulation["worst_gradient_ratio"] <= 1.0, accumulation
    report["compiled_accumulation"] = accumulation
    write_json(output_path(), report)

"""The optimizer stepped inside backward against the same training stepped after it (run under mpiexec).

Two copies of ``unused_parameters.Branchy`` (uses that depend on the step, the data
and the rank: some handles step as their reduction ends, the others at the end of
backward, after the ranks agree which parameters got no gradient), trained on the
same batches: one with ``optimizer.step()`` after backward (whose equivalence with
one process the other workers prove), one inside ``step_in_backward``. Stepping a
handle at a time must be the same step: after every step the parameters and the
optimizer's state are equal to the bit, and the stepped model's gradients are
cleared. Variants: inline and on a thread of its own, offloaded (its gradients coming home as late as from
a GPU: ``late_arrivals.py``), accumulated under
``no_sync()``, with the reduce-scatter asynchronous, NO_SHARD (every rank a
replica), in bf16, with a frozen layer, compiled whole (the graph's handles then
step at the end of backward), with a scheduler, and with the for-loop, foreach and
fused AdamW and SGD with momentum. Inline, some handles must have stepped, and freed their
gradients, before backward reached the first layer. And, first, the refusals. Each part is checked here as
it ends (a broken one ends the job at once); the tests check which parts there were. With
``--device cuda`` (the GPU lane) the GPU variants instead: offloaded (its steps on
the host thread), offloaded with no_sync and bf16, and not offloaded.
"""

import copy
from typing import NamedTuple

import torch
from common import output_path, same_state, take_device_argument, write_json
from late_arrivals import ArrivingLate
from torch import nn
from unused_parameters import STEPS, Branchy, Experts, StaticBranchy, backward, compile_afresh

from fsdp_mpi import (Communicator, CPUOffload, FullyShardedDataParallel, MixedPrecision, ModuleWrapPolicy,
                      ShardingStrategy, clip_grad_norm_, step_in_backward)

OFFLOAD = {"cpu_offload": CPUOffload(offload_params=True)}
LATE = {"cpu_offload": ArrivingLate}  # on the CPU, copies home that land as late as from a GPU (one per model)
BF16 = {"mixed_precision": MixedPrecision(param_dtype=torch.bfloat16)}


class Variant(NamedTuple):
    mode: str  # unused_parameters' accumulation mode: "sync" or "no_sync"
    options: dict  # more FullyShardedDataParallel arguments
    optimizer: str  # make_optimizer's kind
    on_host_thread: bool | None = None  # step_in_backward's
    compiled: bool = False  # torch.compile of the whole model (AOT autograd), on StaticBranchy
    frozen: bool = False  # the root's `side` layer frozen before wrapping: a handle that never steps


VARIANTS = {
    "inline": Variant("sync", {}, "adamw_for_loop"),
    "thread_offloaded": Variant("sync", LATE, "adamw_foreach", on_host_thread=True),
    "no_sync_fused": Variant("no_sync", LATE, "adamw_fused"),
    "async_sgd": Variant("sync", {"async_reduce_scatter": True, "backward_prefetch": True}, "sgd",
                         on_host_thread=True),
    "no_shard": Variant("sync", {"sharding_strategy": ShardingStrategy.NO_SHARD}, "adamw_for_loop"),
    "bf16_offloaded": Variant("sync", {**LATE, **BF16}, "adamw_fused"),
    "frozen_part": Variant("sync", {}, "adamw_for_loop", frozen=True),
    "compiled_no_sync": Variant("no_sync", {}, "adamw_fused", compiled=True),  # StaticBranchy: uses by step only
}
# On a GPU (--device cuda): offloaded (the steps on a host thread, as by default there), and not (inline).
GPU_VARIANTS = {
    "offloaded_on_the_gpu": Variant("sync", OFFLOAD, "adamw_fused"),
    "offloaded_no_sync_bf16_on_the_gpu": Variant("no_sync", {**OFFLOAD, **BF16}, "adamw_fused"),
    "on_the_gpu": Variant("sync", {}, "adamw_fused"),
}


def make_optimizer(kind: str, model: nn.Module):
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=0.1)
    flags = {"adamw_for_loop": {"foreach": False}, "adamw_foreach": {"foreach": True}, "adamw_fused": {"fused": True}}
    return torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1, **flags[kind])


def wrap(reference: nn.Module, comm: Communicator, options: dict,
         device: torch.device | None = None) -> FullyShardedDataParallel:
    """A sharded copy of `reference` (on the CPU: the wrapper places it, offloaded or not, on `device`)."""
    options = {name: value() if value is ArrivingLate else value for name, value in options.items()}
    return FullyShardedDataParallel(copy.deepcopy(reference), comm=comm, device=device,
                                    auto_wrap_policy=ModuleWrapPolicy({nn.Sequential, Experts}), **options)


def variant(comm: Communicator, chosen: Variant, device: torch.device) -> dict:
    mode, options, optimizer_kind, on_host_thread, compiled, frozen = chosen
    torch.manual_seed(0)
    reference = StaticBranchy(with_part=False) if compiled else Branchy()
    if frozen:
        reference.side.requires_grad_(False)
    after, inside = wrap(reference, comm, options, device), wrap(reference, comm, options, device)
    calls = (compile_afresh(after), compile_afresh(inside)) if compiled else (after, inside)
    optimizers = make_optimizer(optimizer_kind, after), make_optimizer(optimizer_kind, inside)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (1 + step)) for optimizer in optimizers]
    report = {"same_parameters": [], "same_optimizer_state": [], "gradients_cleared": []}
    # How many handle steps ran before backward reached the first layer (the last to get its gradient): inline,
    # the units behind it stepped during backward, not after.
    # And whether the branch's unit then holds no gradient (inline, one that stepped has freed it).
    steps, early, branch_free = [0], [], []
    optimizers[1].register_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))

    def count_when_its_gradient_comes(_module, _inputs, output) -> None:
        def count(_):
            early.append(steps[0])
            branch_free.append(all(p.grad is None for p in inside.branch.parameters()))
        output.register_hook(count)

    if not compiled:  # a hook inside the compiled root would break its graph, and so change what it computes
        inside.trunk.register_forward_hook(count_when_its_gradient_comes)
    for step in range(STEPS):
        backward(after, step, comm.world_size, mode, comm.rank, calls[0], device)
        optimizers[0].step()
        optimizers[0].zero_grad(set_to_none=True)
        steps[0] = 0
        with step_in_backward(inside, optimizers[1], on_host_thread=on_host_thread):
            backward(inside, step, comm.world_size, mode, comm.rank, calls[1], device)
        for scheduler in schedulers:
            scheduler.step()
        report["same_parameters"].append(same_state(dict(after.named_parameters()), dict(inside.named_parameters())))
        report["same_optimizer_state"].append(same_state(optimizers[0].state_dict(), optimizers[1].state_dict()))
        report["gradients_cleared"].append(all(p.grad is None for p in inside.parameters()))
    return {**{key: all(comm.all_gather_object(all(values))) for key, values in report.items()},
            "steps_before_first_layers_backward": early, "branch_gradient_freed_by_then": branch_free}


def refusals(comm: Communicator) -> dict:
    """What each misuse raises, as (exception type, message)."""
    torch.manual_seed(0)
    model = wrap(Branchy(), comm, {})
    optimizer = torch.optim.AdamW(model.parameters())

    def raised(action) -> list:
        try:
            action()
        except Exception as error:  # the type and message are what is checked
            return [type(error).__name__, str(error)]
        return ["nothing", ""]

    def clip_after_stepping():
        with step_in_backward(model, optimizer):
            backward(model, 0, comm.world_size, "sync", comm.rank)
        clip_grad_norm_(model, 1.0)

    def no_backward():
        with step_in_backward(model, optimizer):
            pass

    def entered_twice():
        with step_in_backward(model, optimizer), step_in_backward(model, optimizer):
            pass

    foreign = torch.optim.SGD([*model.parameters(), nn.Parameter(torch.zeros(2))], lr=0.1)
    fp16 = wrap(Branchy(), comm, {"mixed_precision": MixedPrecision(param_dtype=torch.float16)})
    return {"clip": raised(clip_after_stepping),
            "clip_after_plain_backward": raised(lambda: (backward(model, 1, comm.world_size, "sync", comm.rank),
                                                         clip_grad_norm_(model, 1.0))),
            "lbfgs": raised(lambda: step_in_backward(model, torch.optim.LBFGS(model.parameters())).__enter__()),
            "foreign": raised(lambda: step_in_backward(model, foreign).__enter__()),
            "nested_unit": raised(lambda: step_in_backward(model.branch, optimizer).__enter__()),
            "fp16": raised(lambda: step_in_backward(fp16, torch.optim.AdamW(fp16.parameters())).__enter__()),
            "no_backward": raised(no_backward),
            "entered_twice": raised(entered_twice)}


# What each misuse must raise: the exception's type and words of its message.
REFUSED = {"clip": ("RuntimeError", "already stepped inside this backward"),
           "clip_after_plain_backward": ("nothing", ""),
           "lbfgs": ("TypeError", "LBFGS needs every gradient"),
           "foreign": ("ValueError", "1 tensors that are not this model's sharded parameters"),
           "nested_unit": ("ValueError", "outermost FullyShardedDataParallel unit"),
           "fp16": ("ValueError", "cannot train in fp16"),
           "no_backward": ("RuntimeError", "no synchronised backward ran inside step_in_backward"),
           "entered_twice": ("RuntimeError", "already entered")}


def check_refusals(refused: dict) -> dict:
    assert set(refused) == set(REFUSED), refused
    for name, (kind, words) in REFUSED.items():
        assert refused[name][0] == kind and words in refused[name][1], (name, refused[name])
    return refused


def check_variant(name: str, result: dict, comm: Communicator) -> dict:
    """Fails where a variant's step differs from the step after backward, or (rank 0's counts, which the report
    keeps) where no handle stepped early: checked as each variant ends, so that a broken one ends the job at
    once. Returns `result`."""
    assert result["same_parameters"] and result["same_optimizer_state"] and result["gradients_cleared"], (name, result)
    early = result["steps_before_first_layers_backward"]
    if comm.rank == 0:
        # The branch's unit (used on even steps, by every rank) steps during backward; experts (one never chosen)
        # and the root (it takes its gradient last) wait for the end of backward.
        if name in ("inline", "bf16_offloaded"):
            assert early == [1, 0, 1, 0], (name, early)
        if name == "no_sync_fused":
            assert early[1::2] == [1, 0, 0, 0], (name, early)  # the synced micro-batches
        if name == "inline":  # stepped and freed, or unused
            assert result["branch_gradient_freed_by_then"] == [True] * STEPS, (name, result)
    return result


if __name__ == "__main__":
    chosen = take_device_argument()
    communicator = Communicator()
    on_gpu = chosen.type == "cuda"
    results = {} if on_gpu else {"refusals": check_refusals(refusals(communicator))}  # the cheapest part first
    for name, arguments in (GPU_VARIANTS if on_gpu else VARIANTS).items():
        results[name] = check_variant(name, variant(communicator, arguments, chosen), communicator)
    write_json(output_path(), results)

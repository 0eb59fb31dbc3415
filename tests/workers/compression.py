"""Compressed communication on several ranks: errors within the format's bounds, bytes, determinism, masters.

    mpiexec -n 3 python compression.py OUT

For gpt2-tiny under each mode (weights and gradients each None, "bf16" or "int8"):

(a) every handle's gathered weights (blocking and prefetched) against the fp32 masters, element by element;
(b) the reduced gradient shard against the exact (float64) sum of what the ranks contributed to the reduction
    (their gradients, already scaled by 1/N in backward as without compression), FULL_SHARD and NO_SHARD;
(c) a step's bytes, as the communicator counts them, against the closed form and the cost model's count;
(d) two identical runs, and one with every overlap switch, give the same bits; AdamW lowers the loss;
(e) state dicts hold the fp32 masters, bit for bit those of an uncompressed model given the same gradients.

Also the communicator's all-to-all (direct, in chunks, staged) and the replicas' compressed all-reduce.

Bounds (u = 2^-24, float32's unit roundoff; docs/communication.md "Compressed communication" derives them):

    int8, an element of a block whose absmax is a:  |decoded - x| <= a (1/254 + 3u)
        half a step (a / 127 / 2), plus the roundings of a / 127, x / scale and code * scale
    bf16:                                           |decoded - x| <= 2^-8 |x| + 2^-134
        round to nearest with 8 significant bits (bf16's eps is 2^-7), and half of bf16's subnormal spacing
    W terms added in fp32 in any order:             gamma(W - 1) * sum of |terms|, gamma(n) = n u / (1 - n u)

Each check reports its worst error / bound over every element; each must be at most 1.
"""

import math
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F
from common import cost_model_units, gpt_batch, local_part, output_path, same_state, write_json

from fsdp_mpi import (Communicator, Compression, FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy,
                      full_state_dict)
from fsdp_mpi.communication.compression import codec, compressed_all_reduce_sum_
from fsdp_mpi.sharding.lifecycle import units_with_names
from fsdp_mpi_models.gpt2 import GPT2Block, GPT2LMHeadModel, gpt2_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
from measuring.costmodel import Layout, Profile, collectives  # noqa: E402

U = torch.finfo(torch.float32).eps / 2
BF16_U = torch.finfo(torch.bfloat16).eps / 2  # 2^-8
BF16_HALF_SUBNORMAL = torch.finfo(torch.bfloat16).tiny * torch.finfo(torch.bfloat16).eps / 2  # 2^-134
INT8_FRACTION_OF_ABSMAX = 1 / 254 + 3 * U
BLOCK = 256  # the default; gpt2-tiny's shards are not whole numbers of blocks on 2 or 3 ranks
MODES = [(weights, gradients) for weights in (None, "bf16", "int8") for gradients in (None, "bf16", "int8")]
STEPS = 4


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


# ----------------------------------------------------------------- bounds, from the formats alone

def encoding_bound(magnitudes: torch.Tensor, mode: str | None) -> torch.Tensor:
    """(R, k) float64 upper bounds on |x| -> (R, k) largest |decode(encode(x)) - x|, rows cut into blocks as
    the codecs cut them (from each row's start; a partial last block)."""
    if mode is None:
        return torch.zeros_like(magnitudes)
    if mode == "bf16":
        return BF16_U * magnitudes + BF16_HALF_SUBNORMAL
    rows, numel = magnitudes.shape
    blocks = -(-numel // BLOCK)
    padded = F.pad(magnitudes, (0, blocks * BLOCK - numel)).view(rows, blocks, BLOCK)
    absmax = padded.amax(dim=-1, keepdim=True).expand_as(padded)
    return (INT8_FRACTION_OF_ABSMAX * absmax).reshape(rows, -1)[:, :numel]


def as_chunks(values: torch.Tensor, group: int) -> torch.Tensor:
    """(n,) -> (group, ceil(n / group)), zero-padded: the chunk bound for each rank of the group."""
    chunk = -(-values.numel() // group)
    return F.pad(values, (0, group * chunk - values.numel())).view(group, chunk)


def reduction_bound(contributions: torch.Tensor, mode: str | None, group: int, then_gather: bool) -> torch.Tensor:
    """contributions (R, n) float64, each rank's input -> (n,) bound on |reduced - their exact sum|.

    Each rank encodes its chunks for the `group` ranks (error per element: `encoding_bound`), the decoded terms
    are added in fp32; with `then_gather` (the replicas' all-reduce) the summed chunks are encoded once more.
    """
    numel = contributions.shape[1]
    encoding = sum(encoding_bound(as_chunks(c.abs(), group), mode).reshape(-1)[:numel] for c in contributions)
    summing = gamma(len(contributions) - 1) * (contributions.abs().sum(dim=0) + encoding)
    bound = encoding + summing
    if then_gather:
        largest_sum = contributions.sum(dim=0).abs() + bound
        bound = bound + encoding_bound(as_chunks(largest_sum, group), mode).reshape(-1)[:numel]
    return bound


def worst_ratio(error: torch.Tensor, bound: torch.Tensor) -> float:
    """max of error / bound; an error where the bound is 0 is infinitely bad."""
    if bool((error[bound == 0] > 0).any()):
        return math.inf
    positive = bound > 0
    return float((error[positive] / bound[positive]).max()) if bool(positive.any()) else 0.0


# ----------------------------------------------------------------- the model

def build(comm, weights=None, gradients=None, strategy=ShardingStrategy.FULL_SHARD, overlap=False):
    torch.manual_seed(0)
    compression = Compression(weights, gradients, BLOCK) if weights or gradients else None
    return FullyShardedDataParallel(GPT2LMHeadModel(gpt2_config("gpt2-tiny")), comm=comm,
                                    auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), compression=compression,
                                    sharding_strategy=strategy, forward_prefetch=overlap, backward_prefetch=overlap,
                                    async_reduce_scatter=overlap)


def handles(model) -> list:
    return [handle for _, unit in units_with_names(model) for handle in unit.handles]


def loss_of(model, comm):
    inputs, targets = gpt_batch(0, 128)
    _, loss = model(local_part(inputs, comm.rank, comm.world_size), local_part(targets, comm.rank, comm.world_size))
    return loss


# ----------------------------------------------------------------- (a) weights, (b) gradients, (c) bytes

def gathered_weights(model, weights) -> dict:
    """(a): every handle gathered (blocking, then prefetched) against its fp32 masters."""
    worst, prefetch_same, changed = 0.0, True, False
    for handle in handles(model):
        masters = handle.gather_masters().double()  # (padded_numel,)
        bound = encoding_bound(masters.abs().view(handle.comm.world_size, -1), weights).reshape(-1)
        gathered = []
        for prefetched in (False, True):
            if prefetched:
                handle.start_unshard()
            handle.unshard()
            gathered.append(handle.full_flat.detach().clone())
            handle.reshard()
        worst = max(worst, worst_ratio((gathered[0].double() - masters).abs(), bound))
        prefetch_same = prefetch_same and torch.equal(*gathered)
        changed = changed or not torch.equal(gathered[0].double(), masters)
    return {"ratio": worst, "prefetch_same": prefetch_same, "changed": changed}


def record_contributions(model) -> dict:
    """What each handle hands to its reduction (its full gradient, already scaled by 1/N), kept as float64."""
    contributions = {}
    for handle in handles(model):
        reduce_gradient = handle.gradient.reduce

        def recording(asynchronous=False, handle=handle, reduce_gradient=reduce_gradient):
            grad = handle.full_flat.grad
            contributions[handle] = (torch.zeros(handle.padded_numel, dtype=torch.float64) if grad is None
                                     else grad.detach().double().clone())
            reduce_gradient(asynchronous)

        handle.gradient.reduce = recording
    return contributions


def reduced_gradients(model, comm, gradients) -> float:
    """(b): one backward; each handle's reduced shard against the exact sum of every rank's contribution."""
    contributions = record_contributions(model)
    loss_of(model, comm).backward()
    worst = 0.0
    for handle in handles(model):
        everyone = torch.stack(comm.all_gather_object(contributions[handle]))  # (world, padded_numel)
        exact = everyone.sum(dim=0)
        if handle.replicas is None:  # FULL_SHARD: reduce-scattered in the shard group
            group, then_gather = handle.comm.world_size, False
        else:  # NO_SHARD: a shard group of one, all-reduced over the replicas
            group, then_gather = handle.replicas.world_size, True
        bound = reduction_bound(everyone, gradients, group, then_gather)
        mine = slice(handle.shard_offset, handle.shard_offset + handle.shard_numel)
        worst = max(worst, worst_ratio((handle.gradient.shard_grad.double() - exact[mine]).abs(), bound[mine]))
    return worst


def wire_bytes(mode: str | None, numel: int) -> int:
    """Bytes of `numel` elements encoded as `mode` (None: fp32)."""
    return {None: 4 * numel, "bf16": 2 * numel, "int8": numel + 4 * -(-numel // BLOCK)}[mode]


def expected_step_bytes(model, weights, gradients) -> dict:
    """(c): the closed form of one forward and backward's bytes per operation.

    FULL_SHARD: each unit's shard gathered in forward and again in backward (the root's only once: it stays
    gathered), W rows of `weights`' wire bytes each; the gradient reduce-scattered (W * S fp32) or, compressed,
    sent as W rows of an all-to-all. NO_SHARD: no gathers; the gradient's chunks of ceil(P / W) all-to-all'ed and
    the sums all-gathered (or one fp32 all-reduce of P). Then 4 bytes per parameter tensor: which got gradients.
    """
    expected = Counter()
    for name, unit in units_with_names(model):
        for handle in unit.handles:
            if handle.replicas is None:
                group, shard = handle.comm.world_size, handle.shard_numel
                expected["all_gather"] += (1 if name == "" else 2) * group * wire_bytes(weights, shard)
                if gradients is None:
                    expected["reduce_scatter"] += group * wire_bytes(None, shard)
                else:
                    expected["all_to_all"] += group * wire_bytes(gradients, shard)
            else:
                replicas = handle.replicas.world_size
                chunk = -(-handle.padded_numel // replicas)
                if gradients is None:
                    expected["all_reduce"] += wire_bytes(None, handle.padded_numel)
                else:
                    expected["all_to_all"] += replicas * wire_bytes(gradients, chunk)
                    expected["all_gather"] += replicas * wire_bytes(gradients, chunk)
            expected["all_reduce"] += 4 * len(handle.slots)
    return dict(expected)


def one_step_checks(comm, weights, gradients, strategy) -> dict:
    model = build(comm, weights, gradients, strategy)
    report = {"weights": gathered_weights(model, weights)} if strategy is ShardingStrategy.FULL_SHARD else {}
    comm.bytes_moved.clear()
    report["gradient_ratio"] = reduced_gradients(model, comm, gradients)
    report["bytes"] = {operation: count for operation, count in comm.bytes_moved.items() if count}
    report["expected_bytes"] = expected_step_bytes(model, weights, gradients)
    report["cost_model_bytes"] = cost_model_bytes(model, comm, weights, gradients, strategy)
    return report


def cost_model_bytes(model, comm, weights, gradients, strategy) -> dict:
    """The cost model's bytes per operation for this model's units, mode and strategy."""
    profile = Profile(cost_model_units(model), optimizer_s=0.0, activation_bytes=0, tokens_per_rank=0, weight_format=weights or "none",
                      gradient_format=gradients or "none", block_size=BLOCK)
    counted = Counter()
    for collective in collectives(profile, Layout(strategy.name, nodes=1, ranks_per_node=comm.world_size)):
        counted[collective.operation] += collective.bytes
    return dict(counted)


# ----------------------------------------------------------------- (d) determinism, (e) masters

def train(comm, weights=None, gradients=None, strategy=ShardingStrategy.FULL_SHARD, overlap=False, replay=None):
    """STEPS of AdamW on one batch: the mean losses, each step's gradients (this rank's views) and the final
    full state dict. With `replay`, no forward or backward: each step's gradients are those given."""
    model = build(comm, weights, gradients, strategy, overlap)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses, gradients_seen = [], []
    for step in range(STEPS):
        if replay is None:
            loss = loss_of(model, comm)
            loss.backward()
            losses.append(comm.all_reduce_sum_float(loss.item()) / comm.world_size)
            gradients_seen.append([None if p.grad is None else p.grad.clone() for p in model.parameters()])
        else:
            for param, grad in zip(model.parameters(), replay[step]):
                param.grad = None if grad is None else grad.clone()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, gradients_seen, full_state_dict(model, rank0_only=False), model


def training_checks(comm, weights, gradients, strategy) -> dict:
    losses, seen, state, model = train(comm, weights, gradients, strategy)
    again_losses, _, again_state, _ = train(comm, weights, gradients, strategy)
    overlapped_losses, _, overlapped_state, _ = train(comm, weights, gradients, strategy, overlap=True)
    _, _, replayed_state, _ = train(comm, strategy=strategy, replay=seen)  # uncompressed, the same gradients
    rank0_state = model.state_dict()
    every_rank_state = comm.all_gather_object(state)
    return {
        "losses": losses,
        "deterministic": losses == again_losses and same_state(state, again_state),
        "overlap_same": losses == overlapped_losses and same_state(state, overlapped_state),
        "masters_as_uncompressed": same_state(state, replayed_state),
        "state_dict_is_full_state_dict": comm.rank != 0 or same_state(rank0_state, state),
        "replicas_identical": all(same_state(state, other) for other in every_rank_state),
        "all_fp32": all(tensor.dtype == torch.float32 for tensor in state.values() if tensor.is_floating_point()),
    }


# ----------------------------------------------------------------- the collectives themselves

def all_to_all_checks(comm) -> dict:
    """Chunk j of every rank's buffer reaches rank j, in rank order: directly, in several messages, staged."""
    world, rank, per_rank = comm.world_size, comm.rank, 5
    codes = torch.tensor([[100 * rank + 10 * j + k for k in range(per_rank)] for j in range(world)])
    expected = torch.tensor([[100 * i + 10 * rank + k for k in range(per_rank)] for i in range(world)])
    staged = Communicator(force_staging=True)
    staged.staging_chunk_bytes = 16  # several chunks per message
    results = {}
    for dtype in (torch.float64, torch.uint8):
        sent = (codes % 251).to(dtype).view(-1)
        for path, communicator in (("direct", comm), ("chunked", comm), ("staged", staged)):
            communicator.max_elements_per_message = 2 if path == "chunked" else 2**31 - 1
            received = torch.empty_like(sent)
            communicator.all_to_all(received, sent)
            results[f"{path}/{dtype}"] = torch.equal(received.view(world, -1), (expected % 251).to(dtype))
    comm.max_elements_per_message = 2**31 - 1
    return results


def replica_all_reduce_checks(comm) -> dict:
    """The replicas' compressed all-reduce on values of many magnitudes, zero blocks and a huge one, 1000
    elements (a multiple of neither the rank count nor the block)."""
    generator = torch.Generator().manual_seed(comm.rank)
    values = torch.randn(1000, generator=generator) * torch.logspace(-6, 3, 1000)
    values[256:512] = 0.0
    values[700] = 1e30 if comm.rank == 0 else -1e29
    everyone = torch.stack(comm.all_gather_object(values)).double()
    report = {}
    for mode in ("bf16", "int8"):
        comm.bytes_moved.clear()
        reduced = values.clone()
        compressed_all_reduce_sum_(comm, reduced, codec(mode, BLOCK))
        bound = reduction_bound(everyone, mode, comm.world_size, then_gather=True)
        chunk = -(-values.numel() // comm.world_size)
        report[mode] = {
            "ratio": worst_ratio((reduced.double() - everyone.sum(dim=0)).abs(), bound),
            "identical_on_every_rank": all(torch.equal(reduced, other) for other in comm.all_gather_object(reduced)),
            "bytes_as_closed_form": dict(comm.bytes_moved) == {
                "all_to_all": comm.world_size * wire_bytes(mode, chunk),
                "all_gather": comm.world_size * wire_bytes(mode, chunk)},
        }
    return report


def over_ranks(comm, report: dict) -> dict:
    """Every rank's report as one: flags true on every rank, the worst ratio, other values as the ranks agree
    on them (else every rank's, in rank order)."""
    def merge(values: list):
        first = values[0]
        if isinstance(first, bool):
            return all(values)
        if isinstance(first, float):
            return max(values)
        if isinstance(first, dict):
            return {key: merge([value[key] for value in values]) for key in first}
        return first if all(value == first for value in values) else values

    return merge(comm.all_gather_object(report))


if __name__ == "__main__":
    comm = Communicator()
    report = {"all_to_all": all_to_all_checks(comm), "replica_all_reduce": replica_all_reduce_checks(comm),
              "full_shard": {}, "no_shard": {}}
    for weights, gradients in MODES:
        mode = f"{weights}/{gradients}"
        report["full_shard"][mode] = {**one_step_checks(comm, weights, gradients, ShardingStrategy.FULL_SHARD),
                                      **training_checks(comm, weights, gradients, ShardingStrategy.FULL_SHARD)}
    for gradients in ("bf16", "int8"):  # NO_SHARD gathers nothing: only the gradients' format matters
        report["no_shard"][gradients] = {
            **one_step_checks(comm, None, gradients, ShardingStrategy.NO_SHARD),
            **training_checks(comm, None, gradients, ShardingStrategy.NO_SHARD)}
    write_json(output_path(), over_ranks(comm, report))

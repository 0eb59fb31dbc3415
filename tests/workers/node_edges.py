"""The node transport at its edges, on 4 ranks of one machine (``--device cuda``: 4 ranks sharing the first GPU):

- three ranks (a communicator of ranks 0-2): a sum started on a side stream, then collectives on the default
  stream that write the same slots again, every rank's result right (on a GPU: a rank waits for its own read of
  a slot, not only its peers', before writing it again);
- HYBRID_SHARD in groups of 2: a shard group and a replica group, each with its own node transport, at once;
  after two steps the replicas hold the same bits;
- memory given back (``close``) and opened again by the next collective; what ``device_bytes_outside_torch``
  counts; the thread's current device left as it was;
- sharing refused on rank 1 alone: every rank takes the same other route and the sums are right.
"""

import torch
from common import ResidualBlock, output_path, take_device_argument, write_json

from fsdp_mpi import Communicator, FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy
from fsdp_mpi.communication.transports import shared_slots


def side_stream(device: torch.device):
    """A stream other than the current one, on a GPU; on the CPU nothing (copies are done when they return)."""
    return torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else _Nothing()


class _Nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def three_ranks(comm: Communicator, device: torch.device) -> dict:
    """All-reduce on a side stream, then two all-gathers on the default stream: the second writes the slot the
    all-reduce read (this rank's own included) again."""
    trio = comm.split(0 if comm.rank < 3 else 1)
    if comm.rank >= 3:
        return {}
    numel = 1000
    values = torch.full((numel,), float(trio.rank + 1), device=device)
    with side_stream(device):
        trio.all_reduce_sum_(values)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    results = {"sum on a side stream": bool(torch.all(values == 6.0))}
    for round_ in range(2):
        full = torch.empty(3 * numel, device=device)
        trio.all_gather_into(full, torch.full((numel,), float(10 * round_ + trio.rank), device=device))
        expected = torch.arange(3, device=device).float().repeat_interleave(numel) + 10 * round_
        results[f"gather {round_} after it"] = torch.equal(full, expected)
    results["routes"] = trio.routes
    return results


def hybrid(comm: Communicator, device: torch.device) -> dict:
    """Two steps of HYBRID_SHARD (groups of 2): shard group and replica group each through the node; the two
    replicas of every shard end bit for bit the same."""
    torch.manual_seed(0)
    model = FullyShardedDataParallel(torch.nn.Sequential(ResidualBlock(16), ResidualBlock(16)), comm=comm,
                                     auto_wrap_policy=ModuleWrapPolicy({ResidualBlock}), device=device,
                                     sharding_strategy=ShardingStrategy.HYBRID_SHARD, hybrid_group_size=2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * step + comm.rank)).to(device)
        model(x).square().mean().backward()
        optimizer.step()
    handle = model.handles[0] if model.handles else next(m for m in model.modules()
                                                         if isinstance(m, FullyShardedDataParallel)
                                                         and m is not model).handles[0]
    shards = comm.all_gather_object([p.detach().cpu() for p in model.parameters()])
    replica = shards[(comm.rank + 2) % 4]  # the rank holding the same part in the other group
    return {"replicas equal": all(torch.equal(a, b) for a, b in zip(shards[comm.rank], replica)),
            "shard group": handle.comm.routes, "replica group": handle.replicas.routes}


def give_back(comm: Communicator, device: torch.device) -> dict:
    before = torch.cuda.current_device() if device.type == "cuda" else None
    held = Communicator()
    values = torch.ones(2**20, device=device)
    held.all_reduce_sum_(values)
    slots = held.transport(device).slots
    counted, own = Communicator.device_bytes_outside_torch(), slots.device_bytes
    results = {"counted while held": counted >= own == (2 * slots.capacity if device.type == "cuda" else 0)}
    held.close()
    results["counted after close"] = Communicator.device_bytes_outside_torch() == counted - own
    held.all_reduce_sum_(values)
    results["sum after reopening"] = bool(torch.all(values == 4 * 4))
    results["current device kept"] = before is None or torch.cuda.current_device() == before
    held.close()
    return results


def refused_on_rank_1(comm: Communicator, device: torch.device) -> dict:
    """Rank 1 cannot map its peers' memory: every rank hears it and takes the route MPI gives."""
    if comm.rank == 1:
        def refuse(*args, **kwargs):
            raise OSError("sharing refused on purpose")
        if device.type == "cuda":
            shared_slots.CudaRuntime.open = refuse
        else:
            shared_slots._map = refuse
    refused = Communicator()
    values = torch.full((1000,), float(comm.rank), device=device)
    refused.all_reduce_sum_(values)
    return {"routes": comm.all_gather_object(refused.routes[device.type]), "sum": bool(torch.all(values == 6.0))}


if __name__ == "__main__":
    device = take_device_argument()
    comm = Communicator()
    report = {"three ranks": three_ranks(comm, device), "hybrid": hybrid(comm, device),
              "give back": give_back(comm, device), "refused on rank 1": refused_on_rank_1(comm, device)}
    write_json(output_path(), report)

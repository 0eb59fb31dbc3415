"""torch's checkpoint layer (``torch.distributed.checkpoint``) over the "fsdp_mpi" backend, as FSDP2's users call
it, on 3 ranks and on a group of 2 of them (run under mpiexec -n 3).

    mpiexec -n 3 python torch_checkpoint.py OUT FOLDER

Every check is data moved, never computed, so each is held to the bit against the state it moved: the model's
and the optimizer's state before a save or a broadcast.

1. The group answers torch's question for its default device (``_get_pg_default_device``: it raised, no
   backend being registered with a Python group).
2. A full state dict set from rank 0 alone (``set_model_state_dict`` / ``set_optimizer_state_dict`` with
   ``broadcast_from_rank0``, how torch's FSDP2 tutorials load a full checkpoint into a sharded model: it raised).
3. A sharded save and load (``dcp.save``, ``dcp.load`` of ``get_state_dict``), and an asynchronous save
   (``dcp.async_save``: it refused, finding no CPU backend).
4. Resharded: saved by FSDP2 on 2 ranks (a device mesh of a group of 2), loaded on 3, saved there, loaded on 2.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import everywhere, output_path, write_json
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, get_state_dict,
                                                     set_model_state_dict, set_optimizer_state_dict, set_state_dict)
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import fsdp_mpi.distributed

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)  # on rank 0 alone: plain tensors in host memory
FROM_RANK_0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


def trained(group: dist.ProcessGroup, seed: int):
    """An FSDP2 model (one unit per layer, and the root; 7, 13 and 5 wide: shards uneven on 2 and on 3 ranks) over
    `group`'s ranks, and its AdamW after one step, so that the optimizer has state to move."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5))
    mesh = DeviceMesh.from_group(group, "cpu")
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 7)).square().sum().backward()
    optimizer.step()
    optimizer.zero_grad()
    return model, optimizer


def full_state(model, optimizer) -> dict:
    """Every tensor of the model's and the optimizer's state, whole, in one flat dict (on rank 0 of the group;
    empty elsewhere)."""
    flat = {f"model/{name}": value for name, value in get_model_state_dict(model, options=FULL).items()}
    optimizer_state = get_optimizer_state_dict(model, optimizer, options=FULL)
    for parameter, state in optimizer_state.get("state", {}).items():
        for key, value in state.items():
            flat[f"optimizer/{parameter}/{key}"] = torch.as_tensor(value)
    return flat


def holds(model, optimizer, expected: dict, group: dist.ProcessGroup | None = None) -> bool:
    """Whether the model and optimizer hold `expected` (rank 0 of `group` compares, its word given to every rank
    of `group`; collective over them)."""
    state = full_state(model, optimizer)
    same = state.keys() == expected.keys() and all(torch.equal(state[key], expected[key]) for key in state)
    return everywhere(same or dist.get_rank(group) != 0, group)


def scrambled(model, optimizer) -> None:
    """Every value of the model's shards and the optimizer's state changed, so that a load that moves nothing
    fails."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *(value for state in optimizer.state.values()
                                              for value in state.values() if torch.is_tensor(value))]:
            tensor.add_(1.0)


def on_one_group(group: dist.ProcessGroup, folder: Path) -> dict:
    """Checks 1-3 on `group`'s ranks (2 on the default group's alone)."""
    results = {"the group's default device is the CPU":
               everywhere(dist.distributed_c10d._get_pg_default_device(group) == torch.device("cpu"), group)}
    model, optimizer = trained(group, seed=0)
    expected = full_state(model, optimizer)
    if group is dist.group.WORLD:  # 2. (torch broadcasts over the default group, whatever the model's mesh)
        model_dict = get_model_state_dict(model, options=FULL)  # rank 0's; the others pass an empty dict
        optimizer_dict = get_optimizer_state_dict(model, optimizer, options=FULL)
        scrambled(model, optimizer)
        set_model_state_dict(model, model_dict, options=FROM_RANK_0)
        set_optimizer_state_dict(model, optimizer, optimizer_dict, options=FROM_RANK_0)
        results["full state dicts set from rank 0 alone"] = holds(model, optimizer, expected, group)
    # 3. sharded, saved and loaded; saved asynchronously and loaded.
    for name, save in (("sharded save and load", dcp.save), ("asynchronous save, then load", dcp.async_save)):
        model_state, optimizer_state = get_state_dict(model, optimizer)
        saving = save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder / name,
                      process_group=group)
        if save is dcp.async_save:
            saving.result()
        scrambled(model, optimizer)
        model_state, optimizer_state = get_state_dict(model, optimizer)
        loaded = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(loaded, checkpoint_id=folder / name, process_group=group)
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
        results[name] = holds(model, optimizer, expected, group)
    return results


def resharded(pair: dist.ProcessGroup | None, folder: Path) -> dict:
    """Check 4: 2 ranks (`pair`, None on the third) save, 3 load and save, 2 load."""
    world = dist.group.WORLD
    on_two = trained(pair, seed=1) if pair is not None else None
    expected = full_state(*on_two) if on_two else {}
    if on_two:
        dcp.save(dict(zip(("model", "optimizer"), get_state_dict(*on_two))), checkpoint_id=folder / "on 2",
                 process_group=pair)
    dist.barrier()
    on_three = trained(world, seed=2)
    state = dict(zip(("model", "optimizer"), get_state_dict(*on_three)))
    dcp.load(state, checkpoint_id=folder / "on 2", process_group=world)
    set_state_dict(*on_three, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    results = {"saved on 2, loaded on 3": holds(*on_three, expected)}
    dcp.save(dict(zip(("model", "optimizer"), get_state_dict(*on_three))), checkpoint_id=folder / "on 3",
             process_group=world)
    if on_two:
        scrambled(*on_two)
        state = dict(zip(("model", "optimizer"), get_state_dict(*on_two)))
        dcp.load(state, checkpoint_id=folder / "on 3", process_group=pair)
        set_state_dict(*on_two, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    results["saved on 3, loaded on 2"] = everywhere(holds(*on_two, expected, pair) if on_two else True)
    return results


if __name__ == "__main__":
    fsdp_mpi.distributed.init_process_group()
    folder = Path(sys.argv[2])
    if dist.get_world_size() != 3:
        sys.exit("torch_checkpoint.py runs on 3 ranks")
    pair = dist.new_group([0, 1])
    report = {f"{check} (3 ranks)": ok for check, ok in on_one_group(dist.group.WORLD, folder / "3").items()}
    if dist.get_rank() in (0, 1):
        report.update({f"{check} (2 ranks)": ok for check, ok in on_one_group(pair, folder / "2").items()})
    report.update(resharded(pair if dist.get_rank() in (0, 1) else None, folder / "resharded"))
    write_json(output_path(), report)
    dist.destroy_process_group()

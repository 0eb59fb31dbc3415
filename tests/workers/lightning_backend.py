"""Lightning's own strategies on the "fsdp_mpi" torch.distributed backend: ``DDPStrategy`` and ``FSDPStrategy``
with ``process_group_backend="fsdp_mpi"``, started by Lightning the usual way (its MPI environment, MASTER_ADDR
and a TCP store), 4 SGD steps on the regression of lightning_strategy.py against one process. ``FSDPStrategy``
runs on a GPU only: it wraps with torch's FSDP1, which refuses a process without an accelerator.

    mpiexec -n 2 python lightning_backend.py OUT [--device cuda]
"""

import lightning as L
import torch
import torch.distributed as dist
from common import output_path, take_device_argument, write_json
from lightning.fabric.plugins.environments import MPIEnvironment
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from lightning_strategy import Regression, max_difference, reference
from mpi4py import MPI

import fsdp_mpi.distributed  # noqa: F401 (registers the backend)


def trained(strategy, device: torch.device) -> dict:
    module = Regression()
    trainer = L.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=MPI.COMM_WORLD.Get_size(),
                        max_steps=4, strategy=strategy, use_distributed_sampler=False, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False)
    trainer.fit(module)
    if isinstance(strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullStateDictConfig, StateDictType
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        with TorchFSDP.state_dict_type(trainer.strategy.model, StateDictType.FULL_STATE_DICT,
                                       FullStateDictConfig(offload_to_cpu=True, rank0_only=False)):
            state = trainer.strategy.model.state_dict()
    else:
        state = module.state_dict()
    return {name.removeprefix("net."): tensor.detach().cpu() for name, tensor in state.items()}


if __name__ == "__main__":
    device = take_device_argument()
    expected, norms = reference(4, None)
    report = {"gradient_norms": norms, "scale": max(float(t.abs().max()) for t in expected.values())}
    strategies = {"ddp": DDPStrategy}
    if device.type == "cuda":
        strategies["fsdp"] = FSDPStrategy
    for name, strategy in strategies.items():
        weights = trained(strategy(process_group_backend="fsdp_mpi", cluster_environment=MPIEnvironment()), device)
        report[f"{name}_max_difference"] = max_difference(weights, expected)
        report[f"{name}_backend"] = dist.get_backend()
    write_json(output_path(), report)

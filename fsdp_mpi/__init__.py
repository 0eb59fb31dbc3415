"""fsdp_mpi: fully sharded data parallel (ZeRO-3) for PyTorch over mpi4py collectives.

    model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    optimizer = torch.optim.AdamW(model.parameters())   # sees only this rank's shards

Read in this order: collective_log -> gpu_support -> staging -> background -> comm -> strategy -> compression
-> flat_param -> mixed_precision -> lifecycle -> state_dict -> clip -> grad_scaler -> deferred_init -> fully_sharded
-> wrap; then checkpoint and pretrained (files on disk) and even_batches; last, lightning (``FSDPMPIStrategy``,
imported only on its own: it needs PyTorch Lightning).
"""

from fsdp_mpi.abort import abort_job_on_uncaught_exception
from fsdp_mpi.checkpoint import CheckpointError, consolidate_checkpoint, load_checkpoint, save_checkpoint
from fsdp_mpi.clip import clip_grad_norm_
from fsdp_mpi.comm import CollectiveMismatchError, Communicator
from fsdp_mpi.compression import Compression
from fsdp_mpi.even_batches import even_batches
from fsdp_mpi.fully_sharded import FSDP, FullyShardedDataParallel
from fsdp_mpi.grad_scaler import ShardedGradScaler
from fsdp_mpi.lifecycle import TrainingState
from fsdp_mpi.mixed_precision import MixedPrecision
from fsdp_mpi.pretrained import PretrainedError, export_pretrained, load_pretrained
from fsdp_mpi.state_dict import full_state_dict, load_full_state_dict, summon_full_params
from fsdp_mpi.strategy import ShardingStrategy
from fsdp_mpi.wrap import ModuleWrapPolicy, SizeBasedWrapPolicy

__all__ = [
    "FSDP",
    "CheckpointError",
    "CollectiveMismatchError",
    "Communicator",
    "Compression",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "PretrainedError",
    "ModuleWrapPolicy",
    "ShardedGradScaler",
    "ShardingStrategy",
    "SizeBasedWrapPolicy",
    "TrainingState",
    "abort_job_on_uncaught_exception",
    "clip_grad_norm_",
    "consolidate_checkpoint",
    "even_batches",
    "export_pretrained",
    "full_state_dict",
    "load_checkpoint",
    "load_full_state_dict",
    "load_pretrained",
    "save_checkpoint",
    "summon_full_params",
]

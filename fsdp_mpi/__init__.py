"""fsdp_mpi: fully sharded data parallel (ZeRO-3) for PyTorch over mpi4py collectives.

    model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}))
    optimizer = torch.optim.AdamW(model.parameters())   # sees only this rank's shards

The package has five layers, each a subpackage, and imports point only downwards:

    communication/   talking to MPI: the Communicator, its log and watchdog, GPU paths, compression
    sharding/        flat shards and the unit lifecycle, state dicts, the FullyShardedDataParallel wrapper
    loop/            what a training loop calls beside the model: clipping, loss scaling, uneven data, dropout,
                     the optimizer's step inside backward
    files/           checkpoints and Hugging Face files on disk
    elastic/         going on after a lost rank (ULFM): the state committed each step, the agreement, the recovery

Read them in that order (each subpackage's docstring orders its files); last, two adapters on top, each
imported only on its own: lightning (``FSDPMPIStrategy``: it needs PyTorch Lightning) and distributed (a
torch.distributed backend named "fsdp_mpi", for torch's own FSDP2 and DDP over the communication layer). The
names below are the public API.
"""

from fsdp_mpi.communication.bookkeeping import CollectiveMismatchError
from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.compression import Compression
from fsdp_mpi.communication.failures.abort import abort_job_on_uncaught_exception
from fsdp_mpi.communication.failures.job import is_newcomer
from fsdp_mpi.communication.failures.lost_ranks import RankLostError, continuation_unavailable
from fsdp_mpi.communication.failures.process_end import exit_without_finalize
from fsdp_mpi.sharding.fully_sharded import FSDP, FullyShardedDataParallel
from fsdp_mpi.sharding.lifecycle import TrainingState
from fsdp_mpi.sharding.mixed_precision import MixedPrecision
from fsdp_mpi.sharding.offload import CPUOffload
from fsdp_mpi.sharding.state_dict import full_state_dict, load_full_state_dict, summon_full_params
from fsdp_mpi.sharding.strategy import ShardingStrategy
from fsdp_mpi.sharding.wrap import ModuleWrapPolicy, SizeBasedWrapPolicy
from fsdp_mpi.loop.clip import clip_grad_norm_
from fsdp_mpi.loop.even_batches import even_batches
from fsdp_mpi.loop.grad_scaler import ShardedGradScaler
from fsdp_mpi.loop.sample_dropout import SampleDropout, SampleKeys, use_sample_dropout
from fsdp_mpi.loop.step_in_backward import step_in_backward
from fsdp_mpi.loop.stop_signals import STOPPED_WITH_CHECKPOINT, StopSignals
from fsdp_mpi.files.checkpoint import CheckpointError, consolidate_checkpoint, load_checkpoint, save_checkpoint
from fsdp_mpi.files.optimizer_state import (OptimizerStateError, full_optimizer_state_dict,
                                           load_full_optimizer_state_dict)
from fsdp_mpi.files.pretrained import PretrainedError, export_pretrained, load_pretrained
from fsdp_mpi.elastic.agreement import StepAbandoned
from fsdp_mpi.elastic.runner import Elastic, run_elastic
from fsdp_mpi.elastic.state import ElasticState

__all__ = [
    "FSDP",
    "CheckpointError",
    "CollectiveMismatchError",
    "Communicator",
    "CPUOffload",
    "Compression",
    "Elastic",
    "ElasticState",
    "FullyShardedDataParallel",
    "MixedPrecision",
    "OptimizerStateError",
    "PretrainedError",
    "RankLostError",
    "SampleDropout",
    "SampleKeys",
    "ModuleWrapPolicy",
    "ShardedGradScaler",
    "ShardingStrategy",
    "StepAbandoned",
    "STOPPED_WITH_CHECKPOINT",
    "StopSignals",
    "SizeBasedWrapPolicy",
    "TrainingState",
    "abort_job_on_uncaught_exception",
    "clip_grad_norm_",
    "consolidate_checkpoint",
    "continuation_unavailable",
    "even_batches",
    "exit_without_finalize",
    "is_newcomer",
    "export_pretrained",
    "full_optimizer_state_dict",
    "full_state_dict",
    "load_checkpoint",
    "load_full_optimizer_state_dict",
    "load_full_state_dict",
    "load_pretrained",
    "run_elastic",
    "save_checkpoint",
    "step_in_backward",
    "summon_full_params",
    "use_sample_dropout",
]

"""The ways of training one model on N ranks that the experiments compare.

``fsdp-mpi`` is ours. ``ddp`` and ``torch-fsdp`` (torch FSDP2's ``fully_shard``)
use torch.distributed, initialised from the MPI ranks that mpiexec started, on
``--backend``: gloo on CPU and nccl on GPU by default, or ``fsdp_mpi``
(torch.distributed over fsdp_mpi's transports, ``fsdp_mpi/distributed/``: MPI from
pip, ranks sharing a GPU). The Lightning strategies live in ``lightning_runner``;
``lightning-fsdp-mpi`` is a Lightning Trainer with fsdp_mpi's ``FSDPMPIStrategy``.

``--precision`` (Lightning's names) maps onto each strategy's own mechanism:
``bf16-mixed`` and ``16-mixed`` gather and compute in 16 bits over fp32 masters
with gradients reduced in fp32 (fsdp-mpi's ``MixedPrecision``, FSDP2's
``MixedPrecisionPolicy``), or run forward under ``torch.autocast`` (DDP, which
keeps fp32 weights). ``16-mixed`` adds loss scaling: fsdp-mpi's
``ShardedGradScaler``, torch's ``GradScaler`` for DDP and FSDP2.
"""

import os
import socket
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
from torch import nn

from training.choices import PRECISIONS, STRATEGIES, compression_formats

from fsdp_mpi import (Communicator, Compression, FullyShardedDataParallel, MixedPrecision, ModuleWrapPolicy,
                      SampleKeys, ShardedGradScaler, clip_grad_norm_, use_sample_dropout)


def torch_backend(backend: str, device: torch.device) -> str:
    """--backend's choice for torch.distributed on `device`: auto is nccl on a GPU, gloo on the CPU."""
    if backend == "fsdp_mpi":
        import fsdp_mpi.distributed  # noqa: F401 (registers the backend)
    if backend == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    return backend


HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # the 16-bit compute dtypes of choices.PRECISIONS


def half_dtype(precision: str) -> torch.dtype | None:
    """The 16-bit dtype that `precision` computes in over fp32 weights; None for 32 (no mixed precision)."""
    return HALF_DTYPES.get(PRECISIONS[precision])


@dataclass
class Prepared:
    """A model ready to train under one strategy."""

    model: nn.Module  # call this for forward passes
    comm_seconds: Callable[[], float]  # time blocked in communication so far (NaN if unknown)
    clip_grad_norm: Callable[[float], torch.Tensor]  # scales all gradients to a total norm of at most max_norm
    no_sync: Callable[[], AbstractContextManager]  # a backward in it keeps gradients for a later one to reduce
    shards_gradients: bool  # whether reduced gradients are sharded (1/N of them per rank)
    scaler: object  # scale(loss), unscale_(optimizer), step(optimizer), update(); a pass-through unless 16-mixed
    all_reduce_max: Callable[[float], float]  # the maximum of a number over all ranks (a stop signal on any rank)
    autocast: Callable[[], AbstractContextManager] = nullcontext  # around forward passes (DDP's mixed precision)
    comm_bytes: Callable[[], int] = lambda: 0  # bytes moved by collectives so far (0 if unknown)


def node_placement(comm: Communicator) -> tuple[int, int]:
    """(this rank's place among the ranks of `comm` on its node, which picks its GPU there; how many ranks the
    node runs). A collective: every rank calls it, never inside set-up that rank 0 runs alone first
    (``training.set_up_rank_0_first``)."""
    node = comm.split(None)
    return node.rank, node.world_size


def init_torch_distributed(comm: Communicator, device: torch.device, backend: str = "auto") -> None:
    """Starts torch.distributed on `backend` (``--backend``) with the MPI ranks and world size; rank 0 hosts the
    rendezvous."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    hostnames = comm.all_gather_object(socket.gethostname())
    address = "127.0.0.1" if len(set(hostnames)) == 1 else hostnames[0]
    port = None
    if comm.rank == 0:
        with socket.socket() as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
    port = comm.broadcast_object(port, root=0)
    os.environ.update(MASTER_ADDR=address, MASTER_PORT=str(port), RANK=str(comm.rank),
                      WORLD_SIZE=str(comm.world_size), LOCAL_RANK=str(node_placement(comm)[0]))
    dist.init_process_group(torch_backend(backend, device), rank=comm.rank, world_size=comm.world_size)


def build_model(task, seed: int, comm: Communicator, deferred: bool = False) -> tuple[nn.Module, SampleKeys]:
    """The same initial weights on every rank, and its dropout drawn per sample (fsdp_mpi.use_sample_dropout):
    (the model, the keys to set before each micro-batch). Then a random stream per rank, for anything else.

    `deferred` (fsdp-mpi): the model is built on the meta device, shapes only, and ``prepare`` draws its weights
    from `seed` as it wraps it, straight into each rank's shards: the weights of the eager build, without ever
    holding the whole model (as a run starts, and as the survivors of a lost rank build it again beside the
    state they go on from)."""
    torch.manual_seed(seed)
    with torch.device("meta") if deferred else nullcontext():
        model = task.build_model()
    keys = use_sample_dropout(model, seed)
    torch.manual_seed(seed * 1000 + 1 + comm.rank)
    return model, keys


def compression_from_option(text: str) -> Compression | None:
    """``--comm-compression WEIGHTS[/GRADIENTS]`` as a ``fsdp_mpi.Compression`` (None: none); one format names
    both. Raises ValueError, naming the choices, for anything else."""
    weights, gradients = compression_formats(text)
    return Compression(weights=weights, gradients=gradients) if weights or gradients else None


def prepare(strategy: str, model: nn.Module, block_class: type, device: torch.device, comm: Communicator,
            precision: str = "32", backend: str = "auto", init_seed: int | None = None, **fsdp_options) -> Prepared:
    """Places `model` on `device` and wraps it for `strategy` (not the Lightning ones) at `precision`, torch's
    strategies on torch.distributed's `backend` (``choices.BACKENDS``).

    `fsdp_options` go to fsdp-mpi's FullyShardedDataParallel (e.g. forward_prefetch=True); torch's strategies
    have no use for them (``options.check_config`` refuses compression for them), but for torch-fsdp's
    ``cpu_offload``, which becomes FSDP2's ``CPUOffloadPolicy``. fsdp-mpi shards
    over `comm` itself, so its communication time and bytes (``comm_seconds``, ``comm_bytes``) also count
    the caller's own collectives on `comm`: compare them around training steps only. `init_seed`: for fsdp-mpi,
    the seed of a model that ``build_model`` built on the meta device, whose weights are drawn as it is wrapped.
    """
    dtype = half_dtype(precision)
    scaling = precision == "16-mixed"
    if strategy == "fsdp-mpi":  # it places the model itself: under cpu_offload only the buffers go to `device`
        deferred = init_seed is not None  # built on meta (build_model): initialised as it is sharded
        with torch.random.fork_rng(devices=[]) if deferred else nullcontext():
            if deferred:
                torch.manual_seed(init_seed)  # the draws of the eager build, in its order (models/initialization.py)
            sharded = FullyShardedDataParallel(model, comm=comm, auto_wrap_policy=ModuleWrapPolicy({block_class}),
                                               mixed_precision=MixedPrecision(param_dtype=dtype), device=device,
                                               param_init_fn=model.init_module if deferred else None, **fsdp_options)
        return Prepared(sharded, lambda: comm.seconds_in_mpi,
                        lambda max_norm: clip_grad_norm_(sharded, max_norm), sharded.no_sync, shards_gradients=True,
                        scaler=ShardedGradScaler(comm, enabled=scaling), all_reduce_max=comm.all_reduce_max_float,
                        comm_bytes=lambda: sum(comm.bytes_moved.values()))
    offload = fsdp_options.get("cpu_offload")  # honoured by torch-fsdp too (bench.py's torch-fsdp+offload)
    offloaded = strategy == "torch-fsdp" and offload is not None and offload.offload_params
    if not offloaded:  # offloaded, FSDP2 keeps the parameters in host memory and moves the buffers itself
        model.to(device)
    init_torch_distributed(comm, device, backend)
    clip_torch = partial(_clip_grad_norm_torch, model)
    autocast, torch_scaler = torch_amp(device.type, precision)
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device_ids = [device.index] if device.type == "cuda" else None
        replicated = DistributedDataParallel(model, device_ids=device_ids)
        return Prepared(replicated, _unknown_comm_seconds, clip_torch, replicated.no_sync, shards_gradients=False,
                        scaler=torch_scaler, all_reduce_max=comm.all_reduce_max_float, autocast=autocast)
    if strategy == "torch-fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)
        # FSDP2's counterpart of CPUOffload: shards, gradients and optimizer state in (pinned, on a GPU) host memory
        placement = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offloaded else OffloadPolicy()
        # On the run's device: fully_shard's default mesh takes the accelerator whenever one is visible, so a
        # CPU run on a GPU machine would put rank k on GPU k (and fail where there are fewer GPUs than ranks).
        mesh = init_device_mesh(device.type, (comm.world_size,))
        for module in model.modules():
            if isinstance(module, block_class):
                fully_shard(module, mesh=mesh, mp_policy=policy, offload_policy=placement)
        fully_shard(model, mesh=mesh, mp_policy=policy, offload_policy=placement)
        return Prepared(model, _unknown_comm_seconds, clip_torch, lambda: _fsdp2_no_sync(model), shards_gradients=True,
                        scaler=torch_scaler, all_reduce_max=comm.all_reduce_max_float)
    raise ValueError(f"unknown strategy {strategy!r}; choose one of {', '.join(STRATEGIES)}")


def torch_amp(device_type: str, precision: str):
    """torch's own mixed precision for `precision`: (an autocast context factory, a GradScaler)."""
    dtype = half_dtype(precision)
    autocast = partial(torch.autocast, device_type, dtype=dtype, enabled=dtype is not None)
    return autocast, torch.amp.GradScaler(device_type, enabled=precision == "16-mixed")


def _unknown_comm_seconds() -> float:
    return float("nan")


def _clip_grad_norm_torch(model: nn.Module, max_norm: float) -> torch.Tensor:
    """torch's clipping over all of `model`'s gradients (DDP's replicas, or FSDP2's sharded DTensors)."""
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


@contextmanager
def _fsdp2_no_sync(model):
    """FSDP2's counterpart of DDP's ``no_sync()``: backward keeps unsharded gradients, unreduced."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_state_dict_on_rank0(strategy: str, model: nn.Module, comm: Communicator) -> dict | None:
    """The trained model's full state dict (original names, on CPU) on rank 0; None elsewhere."""
    if strategy == "fsdp-mpi":
        state = model.state_dict()
    elif strategy == "torch-fsdp":
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    else:
        state = getattr(model, "module", model).state_dict()
    return {name: tensor.cpu() for name, tensor in state.items()} if comm.rank == 0 else None

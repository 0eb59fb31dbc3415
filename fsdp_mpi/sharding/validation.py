"""Checks run at wrap time, so that bad input fails with a clear message before any sharding.

Every check that can differ between ranks goes through a collective whose result
all ranks see, so all ranks raise the same error together instead of some of
them waiting forever in the next collective.
"""

import hashlib

import torch
from torch import nn

from fsdp_mpi.communication.comm import Communicator


def check_module_can_be_sharded(module: nn.Module, device: torch.device | None) -> None:
    """Raises ValueError/TypeError for modules the sharding layer cannot handle."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"FullyShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
    params = list(module.named_parameters())
    if not params:
        raise ValueError(f"{type(module).__name__} has no parameters: there is nothing to shard")
    not_float = [f"{name} ({p.dtype})" for name, p in params if not p.is_floating_point()]
    if not_float:
        raise TypeError("only floating-point parameters can be sharded; found " + ", ".join(not_float))
    devices = {p.device for _, p in params}
    if device is None and len(devices) > 1:
        listing = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"parameters are on several devices ({listing}); move the module to one device "
            "or pass device= to FullyShardedDataParallel"
        )


def model_fingerprint(module: nn.Module) -> str:
    """A digest of every parameter's and buffer's name, shape, dtype and requires_grad."""
    digest = hashlib.sha256()
    for name, param in module.named_parameters():
        digest.update(f"p {name} {tuple(param.shape)} {param.dtype} {param.requires_grad};".encode())
    for name, buffer in module.named_buffers():
        digest.update(f"b {name} {tuple(buffer.shape)} {buffer.dtype};".encode())
    return digest.hexdigest()[:16]


def check_same_model_on_all_ranks(module: nn.Module, comm: Communicator) -> None:
    """Raises ValueError on every rank if any rank holds a differently shaped model."""
    fingerprints = comm.all_gather_object(model_fingerprint(module))
    differing = [rank for rank, fingerprint in enumerate(fingerprints) if fingerprint != fingerprints[0]]
    if differing:
        raise ValueError(
            f"ranks {differing} hold a different model than rank 0 (parameter and buffer names, "
            "shapes, dtypes or requires_grad differ); every rank must build the same model before wrapping"
        )

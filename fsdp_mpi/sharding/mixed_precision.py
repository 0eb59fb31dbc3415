"""Mixed precision: fp32 master shards, low-precision gathers and compute.

What is in which dtype, with ``MixedPrecision(param_dtype=torch.bfloat16)``:

    shard (the master copy the optimizer updates)      float32, always
    all-gathered full parameters, the module's math    param_dtype (cast once per gather, on the shard)
    floating-point inputs of every unit's forward      cast to param_dtype (as torch FSDP2 does)
    gradient autograd leaves on the full parameters    param_dtype
    the gradient reduce-scatter                        reduce_dtype (default: float32, the shard's dtype)
    .grad of each sharded view                         float32, always
    floating-point buffers                             buffer_dtype, cast once at wrap time (default: unchanged)
    state dicts, summon_full_params                    float32 (gathered from the master shards)

Unlike torch FSDP, a ``reduce_dtype`` left unset reduces in fp32, not in
``param_dtype``: MPI has no 16-bit float sum, so fsdp_mpi sums 16-bit gradients
in fp32 anyway (4 bytes per element on the wire), and reducing in 16 bits would
add rounding for no saving. ``reduce_dtype=torch.bfloat16`` is accepted and
means: round the gradient to bf16, sum in fp32, round the mean to bf16.
"""

from dataclasses import dataclass

import torch

from fsdp_mpi.sharding.nested import map_tensors


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for a sharded module's compute, gradient reduction and buffers (None: keep the parameter's)."""

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None

    def __post_init__(self):
        for field in ("param_dtype", "reduce_dtype", "buffer_dtype"):
            dtype = getattr(self, field)
            if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
                raise TypeError(f"MixedPrecision.{field} must be a floating-point torch.dtype, got {dtype!r}")


def cast_floating_tensors(value, dtype: torch.dtype):
    """`value` with every floating-point tensor nested in it cast to `dtype`, each container keeping its type."""
    return map_tensors(lambda tensor: tensor.to(dtype) if tensor.is_floating_point() else tensor, value)

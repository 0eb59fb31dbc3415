"""torch FSDP's option objects read as fsdp_mpi's, so that code written for torch's FSDP wraps as it is.

    torch.distributed.fsdp.ShardingStrategy.X, "X"   ->  ShardingStrategy.X (the same names; Lightning's strings)
    torch.distributed.fsdp.CPUOffload(offload_params) ->  CPUOffload(offload_params)
    torch.distributed.fsdp.MixedPrecision(...)       ->  MixedPrecision(param_dtype, reduce_dtype, buffer_dtype),
                                                         refused with keep_low_precision_grads=True (a sharded
                                                         view's .grad is fp32 here, always)

Where the two differ, fsdp_mpi's rules apply (``mixed_precision.py``): every unit's floating-point inputs are cast
to ``param_dtype``, and with ``reduce_dtype`` unset gradients are summed in fp32. torch's classes are recognised by
module and name, so torch's FSDP package is never imported for them. Anything else is a TypeError that names
what is expected, before anything is wrapped.
"""

from fsdp_mpi.sharding.mixed_precision import MixedPrecision
from fsdp_mpi.sharding.offload import CPUOffload
from fsdp_mpi.sharding.strategy import ShardingStrategy


def _is_torch_fsdp(value, class_name: str) -> bool:
    """Whether `value` is an instance of torch FSDP's class `class_name` (without importing torch's FSDP)."""
    kind = type(value)
    return kind.__name__ == class_name and kind.__module__.startswith("torch.distributed.fsdp")


def read_sharding_strategy(value) -> ShardingStrategy:
    """Ours; torch FSDP's member of the same name; or the name itself in any case (Lightning's FSDPStrategy
    takes ``"FULL_SHARD"``)."""
    if isinstance(value, ShardingStrategy):
        return value
    if isinstance(value, str):
        name = value.upper()
    elif _is_torch_fsdp(value, "ShardingStrategy"):
        name = value.name
    else:
        name = None
    if name in ShardingStrategy.__members__:
        return ShardingStrategy[name]
    raise TypeError(f"sharding_strategy must be fsdp_mpi.ShardingStrategy ({', '.join(ShardingStrategy.__members__)}),"
                    f" torch FSDP's of the same name, or the name, got {value!r}")


def read_mixed_precision(value) -> MixedPrecision:
    """Ours (None: nothing cast), or torch FSDP's dtypes in ours."""
    if value is None:
        return MixedPrecision()
    if isinstance(value, MixedPrecision):
        return value
    if _is_torch_fsdp(value, "MixedPrecision"):
        if value.keep_low_precision_grads:
            raise TypeError("MixedPrecision(keep_low_precision_grads=True) is not supported: a sharded parameter's "
                            ".grad is in the shard's dtype (fp32), which the optimizer steps")
        return MixedPrecision(value.param_dtype, value.reduce_dtype, value.buffer_dtype)
    raise TypeError(f"mixed_precision must be a fsdp_mpi.MixedPrecision or torch FSDP's, got {value!r}")


def read_cpu_offload(value) -> CPUOffload | None:
    """Ours or None as given, or torch FSDP's ``offload_params`` in ours."""
    if value is None or isinstance(value, CPUOffload):
        return value
    if _is_torch_fsdp(value, "CPUOffload"):
        return CPUOffload(offload_params=value.offload_params)
    raise TypeError(f"cpu_offload must be a fsdp_mpi.CPUOffload or torch FSDP's, got {value!r}")

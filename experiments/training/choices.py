"""The names the experiments' command lines accept (strategies, torch.distributed backends, precisions,
``--comm-compression`` formats) and which strategies take which, importable without torch or fsdp_mpi: bench.py's
launcher checks a plan against them before it starts a rank, and a launcher must not start MPI itself (some
clusters' MPI expects every MPI process to come from its launcher)."""

STRATEGIES = ("fsdp-mpi", "ddp", "torch-fsdp", "lightning-ddp", "lightning-fsdp", "lightning-fsdp-mpi")  # --strategy
TORCH_DISTRIBUTED = ("ddp", "torch-fsdp", "lightning-ddp", "lightning-fsdp")  # those that communicate through torch
COMPRESSING = ("fsdp-mpi", "lightning-fsdp-mpi")  # those that communicate through fsdp_mpi: --comm-compression's

SHARDING_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD", "NO_SHARD")  # --sharding-strategy, fsdp-mpi's
REPLICATED = ("HYBRID_SHARD", "NO_SHARD")  # those where every shard has replicas: --keep-going goes on from memory

BACKENDS = ("auto", "gloo", "nccl", "fsdp_mpi")  # --backend: torch.distributed's, for TORCH_DISTRIBUTED

PRECISIONS = {"32": "fp32", "bf16-mixed": "bf16", "16-mixed": "fp16"}  # --precision -> the matrix products' dtype

FORMATS = ("none", "bf16", "int8")  # --comm-compression's, for the weights and for the gradients


def compression_formats(text: str) -> tuple[str | None, str | None]:
    """(the weights' format, the gradients' format) that `text` names, None for "none"; one format names both.
    Raises ValueError, naming the choices, for anything else."""
    formats = text.split("/")
    if len(formats) == 1:
        formats *= 2
    if len(formats) != 2 or not set(formats) <= set(FORMATS):
        raise ValueError(f"--comm-compression {text!r}: expected WEIGHTS or WEIGHTS/GRADIENTS, each one of "
                         f"{', '.join(FORMATS)} (e.g. int8/bf16)")
    weights, gradients = (None if name == "none" else name for name in formats)
    return weights, gradients

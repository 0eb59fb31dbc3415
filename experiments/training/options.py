"""The experiments' command line, the ``RunConfig`` it becomes, and the checks that refuse what cannot run.

The parser exists only in ``run.main``: it turns the command line into a
``RunConfig`` (frozen; field names are the options' names), and everything after
reads that. A checkpoint compares its fields on resume, and ``run.json`` records them.
"""

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

from training.choices import (BACKENDS, COMPRESSING, PRECISIONS, REPLICATED, SHARDING_STRATEGIES, STRATEGIES,
                              TORCH_DISTRIBUTED)
from training.resume import LATEST
from training.sampling import Batching
from training.strategies import compression_from_option


class UsageError(Exception):
    """A combination of options that cannot run here."""


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """One training run's settings, as both experiments' command lines give them."""

    # What is trained, and by whom.
    model: str
    strategy: str  # choices.STRATEGIES
    sharding_strategy: str  # fsdp-mpi's: a fsdp_mpi.ShardingStrategy's name
    backend: str  # choices.BACKENDS: torch.distributed's, for its strategies
    precision: str  # choices.PRECISIONS
    comm_compression: str  # WEIGHTS[/GRADIENTS], strategies.compression_from_option
    cpu_offload: bool  # fsdp-mpi: shards, their gradients and the optimizer state in host memory
    gradient_checkpointing: bool
    dropout: float | None  # every dropout layer's probability; None: the model's
    # The data: sequence length, batches, how long.
    seq_len: int
    batch_size: int
    grad_accum: int
    accum_no_sync: bool  # reduce gradients on a step's last micro-batch only, also under sharded strategies
    epochs: int
    steps_per_epoch: int
    val_steps: int  # validation batches per rank after each epoch
    seed: int
    # The optimisation recipe (recipe.py).
    lr: float
    warmup_steps: int | None  # None: a tenth of the run's optimizer steps
    weight_decay: float
    clip_norm: float  # 0: no clipping
    step_in_backward: bool  # fsdp-mpi: the optimizer steps each unit inside backward (fsdp_mpi.step_in_backward)
    # Where it runs, and where files go.
    threads: int
    device: str  # auto, cpu, cuda
    data_dir: str | None
    no_download: bool
    out_dir: str
    run_id: str | None
    save_dir: str | None
    no_progress: bool
    checkpoint_dir: str | None
    checkpoint_every: int
    resume: bool
    keep_going: bool  # fsdp-mpi: go on without a lost rank, in the same job (keep_going.py)
    grow_back: bool  # with keep_going: newcomers in the lost ranks' places, as many ranks as before
    add_hosts: str | None  # with grow_back: the hosts file read at step boundaries (fsdp_mpi.run_elastic's)

    @classmethod
    def from_namespace(cls, namespace: argparse.Namespace) -> "RunConfig":
        """The parsed command line as a config; a parser option without a field here is a TypeError."""
        return cls(**vars(namespace))

    @classmethod
    def from_saved(cls, parser: argparse.ArgumentParser, saved: dict, **overrides) -> "RunConfig":
        """A config from the parser's defaults, the `saved` options this config knows (run.json), then `overrides`."""
        values = vars(parser.parse_args([]))
        values.update({name: value for name, value in saved.items() if name in values})
        return cls(**{**values, **overrides})

    def as_dict(self) -> dict:
        return asdict(self)

    @property
    def batching(self) -> Batching:
        return Batching(self.batch_size, self.grad_accum, self.steps_per_epoch)


def argument_parser(description: str, model_choices, defaults: dict) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    add = parser.add_argument
    add("--model", default=defaults["model"], choices=model_choices, help="named model configuration")
    add("--strategy", default="fsdp-mpi", choices=STRATEGIES, help="who trains (default: %(default)s)")
    add("--sharding-strategy", default="FULL_SHARD", choices=SHARDING_STRATEGIES,
        help="fsdp-mpi's sharding strategy; HYBRID_SHARD's groups are the nodes, or FSDP_MPI_HYBRID_GROUP_SIZE "
             "consecutive ranks (default: %(default)s)")
    add("--backend", default="auto", choices=BACKENDS,
        help="torch.distributed's backend for ddp, torch-fsdp, lightning-ddp and lightning-fsdp: auto (nccl on "
             "GPUs, gloo otherwise), or fsdp_mpi (over fsdp_mpi's MPI and node transport) (default: %(default)s)")
    add("--epochs", type=int, default=defaults["epochs"])
    add("--steps-per-epoch", type=int, default=defaults["steps_per_epoch"], help="optimizer steps; 0: the whole epoch")
    add("--batch-size", type=int, default=defaults["batch_size"], help="samples per rank per micro-batch")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step (default: %(default)s)")
    add("--accum-no-sync", action="store_true",
        help="reduce gradients only on an optimizer step's last micro-batch (sharded strategies otherwise reduce each)")
    add("--seq-len", type=int, default=defaults["seq_len"])
    add("--precision", default="32", choices=list(PRECISIONS),
        help="32, or 16-bit compute over fp32 weights: bf16-mixed, 16-mixed (fp16, loss scaling) (default: %(default)s)")
    add("--comm-compression", default="none", metavar="WEIGHTS[/GRADIENTS]",
        help="fsdp-mpi: gather weights and reduce gradients in fewer bytes, each none, bf16 or int8 (per-block "
             "scales); the model still computes in --precision, masters and checkpoints stay fp32 (default: none)")
    add("--cpu-offload", action="store_true",
        help="fsdp-mpi: keep the shards, their gradients and the optimizer state in host memory, the device "
             "holding only the unit that computes (a model larger than the GPU; the optimizer steps on the CPU)")
    add("--lr", type=float, default=defaults["lr"], help="peak learning rate (default: %(default)s)")
    add("--warmup-steps", type=int, default=None,
        help="optimizer steps of linear warm-up (default: a tenth of the run's steps)")
    add("--weight-decay", type=float, default=0.1, help="AdamW's, on weights and embeddings (default: %(default)s)")
    add("--clip-norm", type=float, default=1.0, help="gradient-norm clipping threshold; 0: none (default: %(default)s)")
    add("--step-in-backward", action="store_true",
        help="fsdp-mpi: the optimizer steps each unit's shards inside backward as their gradients are final "
             "(on a host thread, overlapped, when offloaded from a GPU); needs --clip-norm 0, not 16-mixed")
    add("--seed", type=int, default=0)
    add("--val-steps", type=int, default=10, help="validation batches per rank after each epoch")
    add("--threads", type=int, default=1, help="torch threads per rank")
    add("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: one GPU per rank if any")
    add("--data-dir", default=None, help="default: $FSDP_MPI_DATA_DIR, else ~/.cache/fsdp_mpi/data")
    add("--no-download", action="store_true", help="never fetch missing data files")
    add("--out-dir", default="results", help="where the CSV goes (default: %(default)s)")
    add("--run-id", default=None, help="default: experiment, strategy, ranks and a random suffix")
    add("--save-dir", default=None, help="save the trained model here (Hugging Face layout)")
    add("--no-progress", action="store_true", help="no progress bar")
    add("--checkpoint-dir", default=None,
        help="fsdp-mpi: save resumable checkpoints here (DIR/step-NNNNNNNN/, DIR/latest), at the end and on "
             "SIGTERM or SIGUSR1")
    add("--checkpoint-every", type=int, default=0,
        help="optimizer steps between checkpoints; 0: only at the end and on a signal (default: %(default)s)")
    add("--resume", action="store_true",
        help="continue from the latest checkpoint in --checkpoint-dir; start fresh if there is none")
    add("--keep-going", action="store_true",
        help="fsdp-mpi under `mpirun --with-ft ulfm --mca btl tcp,self` (Open MPI): a lost rank does not end the "
             "job; the survivors go on (HYBRID_SHARD, NO_SHARD: the replicas left, from memory; otherwise from "
             "the latest checkpoint, which --checkpoint-dir then needs)")
    add("--grow-back", action="store_true",
        help="with --keep-going: after a loss, start a newcomer in each lost rank's place (on its node where that "
             "lives on, else in a free slot of the allocation) and go on with as many ranks as before")
    add("--add-hosts", default=None, metavar="FILE",
        help="with --grow-back: a file of HOST:SLOTS lines, read at every step boundary while ranks are missing; "
             "hosts written into it are added to the allocation and the run grows back into them")
    add("--gradient-checkpointing", action="store_true", help="recompute activations in backward")
    add("--dropout", type=float, default=None, metavar="P",
        help="every dropout layer's probability (default: the model's); masks are drawn per sample, the same on "
             "any number of ranks")
    return parser


def check_checkpoint_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuses checkpoint options that cannot work (argparse's usage error: exit code 2)."""
    if args.checkpoint_dir is None and (args.resume or args.checkpoint_every):
        parser.error("--resume and --checkpoint-every need --checkpoint-dir")
    if args.checkpoint_dir is not None and args.strategy != "fsdp-mpi":
        parser.error(f"--checkpoint-dir needs --strategy fsdp-mpi: {args.strategy} runs cannot be checkpointed "
                     "and resumed here (leave out --checkpoint-dir, --checkpoint-every and --resume)")
    if args.checkpoint_every < 0:
        parser.error("--checkpoint-every must be 0 (only at the end and on a signal) or positive")


def check_step_in_backward(config: RunConfig) -> None:
    """Raises UsageError where the optimizer cannot step inside backward (fsdp_mpi.step_in_backward)."""
    if config.strategy != "fsdp-mpi":
        raise UsageError(f"--step-in-backward is fsdp-mpi's: {config.strategy} steps its optimizer after backward")
    if config.clip_norm:
        raise UsageError("--step-in-backward needs --clip-norm 0: clipping needs every gradient before the first "
                         "unit steps")
    if config.precision == "16-mixed":
        raise UsageError("--step-in-backward trains in 32 or bf16-mixed: fp16's loss scaling would have to skip "
                         "steps already taken")
    if config.keep_going:
        raise UsageError("--step-in-backward and --keep-going do not go together: the survivors agree on a step "
                         "before taking it, and inside backward it is already taken")


def check_config(config: RunConfig) -> None:
    """Raises UsageError for values no run can use, and for a fresh run into a used --checkpoint-dir."""
    for name in ("epochs", "batch_size", "grad_accum", "seq_len", "threads", "val_steps"):
        if getattr(config, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be at least 1")
    if config.steps_per_epoch < 0:
        raise UsageError("--steps-per-epoch must be 0 (whole epoch) or positive")
    if config.backend != "auto" and config.strategy not in TORCH_DISTRIBUTED:
        raise UsageError(f"--backend {config.backend} is torch.distributed's, which {config.strategy} does not use "
                         f"(it is for {', '.join(TORCH_DISTRIBUTED)})")
    if not config.lr > 0:
        raise UsageError("--lr must be positive")
    if config.dropout is not None and not 0 <= config.dropout < 1:
        raise UsageError("--dropout must be at least 0 and below 1")
    try:
        compression = compression_from_option(config.comm_compression)
    except ValueError as error:
        raise UsageError(str(error)) from None
    if compression is not None and config.strategy not in COMPRESSING:
        raise UsageError(f"--comm-compression is fsdp_mpi's: {config.strategy} communicates through torch "
                         f"(use --strategy {' or '.join(COMPRESSING)})")
    if config.cpu_offload and config.strategy not in COMPRESSING:
        raise UsageError(f"--cpu-offload is fsdp_mpi's: {config.strategy} keeps its state where torch puts it "
                         f"(use --strategy {' or '.join(COMPRESSING)})")
    if config.step_in_backward:
        check_step_in_backward(config)
    for name in ("warmup_steps", "weight_decay", "clip_norm"):
        if (getattr(config, name) or 0) < 0:
            raise UsageError(f"--{name.replace('_', '-')} must not be negative")
    if config.sharding_strategy != "FULL_SHARD" and config.strategy != "fsdp-mpi":
        raise UsageError(f"--sharding-strategy is fsdp-mpi's; {config.strategy} shards as it does")
    if config.keep_going and config.strategy != "fsdp-mpi":
        raise UsageError(f"--keep-going needs --strategy fsdp-mpi: {config.strategy} communicates through torch, "
                         "which cannot go on without a lost rank")
    if config.grow_back and not config.keep_going:
        raise UsageError("--grow-back puts the ranks back after a loss that --keep-going survives: give both")
    if config.add_hosts and not config.grow_back:
        raise UsageError("--add-hosts names hosts to grow back into: it needs --grow-back")
    if config.keep_going and not config.checkpoint_every and config.sharding_strategy not in REPLICATED:
        raise UsageError(f"--keep-going under {config.sharding_strategy} goes on from the latest checkpoint (no "
                         f"rank left holds the lost rank's shards): give it a --checkpoint-dir and --checkpoint-every "
                         f"N (the steps a loss may repeat), or shard with {' or '.join(REPLICATED)}")
    if config.checkpoint_dir and not config.resume and (Path(config.checkpoint_dir) / LATEST).exists():
        raise UsageError(f"{config.checkpoint_dir} already holds checkpoints: pass --resume to continue from the "
                         "latest, or choose another --checkpoint-dir")

"""Evaluate a model saved by ``run_gpt2.py`` / ``run_bert.py --save-dir``: quality, speed and size in fp32, bf16, int8.

    python experiments/eval.py runs/shakespeare                 # one process
    mpiexec -n 2 python experiments/eval.py runs/shakespeare    # fp32 and bf16 sharded over the ranks

For each precision: validation loss and perplexity (GPT-2) or masked-LM and NSP
accuracy (BERT) on the run's own validation split, rebuilt from the ``run.json``
that training wrote beside the weights; latency percentiles and throughput of a
forward pass (with its loss) at batch 1 and at ``--batch-size``; and the bytes of
the weights. ``bf16`` casts every weight; ``int8`` is torch's dynamic quantization
of the Linear layers (int8 weights, activations quantized per batch by the CPU's
int8 kernels; GPT-2's Conv1D layers become Linear first). One row per precision
and batch size goes to ``--out-dir/eval-<run id>-n<ranks>.csv``, which compare.py
shows beside training results.

Under mpiexec, fp32 and bf16 are built on the meta device and read straight into
shards, so no rank holds the whole model; the ranks split the validation data,
and a timed forward pass is every rank's batch at once. int8 cannot be sharded
(its weights are packed for the CPU kernels, not flat tensors), so there each rank
holds a whole int8 copy and evaluates its part of the data.
"""

import argparse
import sys
import time
import warnings
from datetime import datetime, timezone
from pathlib import Path

import numpy
import torch
from torch import nn
from torch.ao.nn.quantized.dynamic import Linear as DynamicQuantizedLinear

import run_bert
import run_gpt2
from compare import markdown
from corpora.files import DataError
from training.evaluation import evaluate, to_device
from training.options import RunConfig, UsageError
from training.results import EVAL_COLUMNS, CsvWriter, git_commit
from training.saved_run import SavedRunError, read_run_file
from training.startup import announce_devices, communicator_for_the_run, pick_device, set_up_rank_0_first
from training.strategies import node_placement

from fsdp_mpi import (Communicator, FullyShardedDataParallel, ModuleWrapPolicy, PretrainedError,
                      abort_job_on_uncaught_exception, load_pretrained)
from fsdp_mpi_models.checkpoint import PretrainedCheckpointError
from fsdp_mpi_models.gpt2 import Conv1D

EXPERIMENTS = {"gpt2": (run_gpt2.GPT2Task, run_gpt2.GPT2RunConfig, run_gpt2.parser),
               "bert": (run_bert.BertTask, RunConfig, run_bert.parser)}
PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": None}
WARM_UP = 2  # untimed forward passes before each timing (first-call allocations, kernel selection)
MIN_TIMED, MAX_TIMED = 10, 1000  # forward passes per timing, whatever --timing-seconds says
UNUSABLE_RUN = (SavedRunError, DataError, UsageError, PretrainedCheckpointError, PretrainedError, ValueError, OSError)


def parser() -> argparse.ArgumentParser:
    result = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = result.add_argument
    add("run_dir", help="a directory written by run_gpt2.py or run_bert.py --save-dir")
    add("--precisions", default="fp32,bf16,int8", help="comma-separated, of fp32, bf16, int8 (default: %(default)s)")
    add("--batch-size", type=int, default=16, help="the larger batch, per rank, beside batch 1 (default: %(default)s)")
    add("--val-steps", type=int, default=0, help="validation batches per rank; 0: the whole split (default)")
    add("--timing-seconds", type=float, default=5.0,
        help=f"time spent timing each precision and batch size ({MIN_TIMED} to {MAX_TIMED} passes; default: %(default)s)")
    add("--threads", type=int, default=1, help="torch threads per rank (default: %(default)s)")
    add("--device", default="cpu", choices=("auto", "cpu", "cuda"), help="auto: one GPU per rank if any")
    add("--data-dir", default=None, help="default: $FSDP_MPI_DATA_DIR, else ~/.cache/fsdp_mpi/data")
    add("--no-download", action="store_true", help="never fetch missing data files")
    add("--out-dir", default="results", help="where the CSV goes (default: %(default)s)")
    return result


class SavedRun:
    """The run a --save-dir directory describes: its task (validation data, model shape) and where the weights are."""

    def __init__(self, args, comm: Communicator):
        self.directory = Path(args.run_dir)
        self.description = read_run_file(self.directory, EXPERIMENTS)
        self.experiment = self.description["experiment"]
        task_type, config_type, experiment_parser = EXPERIMENTS[self.experiment]
        config = config_type.from_saved(experiment_parser(), self.description["options"], data_dir=args.data_dir,
                                        no_download=args.no_download, gradient_checkpointing=False)
        self.seed = config.seed
        self.task = task_type(config, comm)
        self.parameters = self.skeleton().num_parameters()
        self.git_commit = git_commit()  # of the code evaluating

    def skeleton(self, dtype: torch.dtype = torch.float32) -> nn.Module:
        """The run's model on the meta device: shapes and dtypes only."""
        with torch.device("meta"):
            return self.task.build_model().to(dtype)

    def whole(self) -> nn.Module:
        """The saved fp32 model, read whole; PretrainedCheckpointError if it is not the model run.json describes."""
        skeleton = self.skeleton()
        model = type(skeleton).from_pretrained(self.directory)
        expected = {name: tuple(p.shape) for name, p in skeleton.named_parameters()}
        saved = {name: tuple(p.shape) for name, p in model.named_parameters()}
        if saved != expected:
            differing = sorted(name for name in expected.keys() | saved.keys() if expected.get(name) != saved.get(name))
            raise PretrainedCheckpointError(f"{self.directory}: the weights are not those of the model run.json "
                                            f"describes ({self.task.model_name}); differing: "
                                            f"{', '.join(differing[:5])}")
        return model.eval()

    def sharded(self, dtype: torch.dtype, comm: Communicator, device: torch.device) -> nn.Module:
        """The saved model in `dtype`, built on meta and read straight into this rank's shards."""
        skeleton = self.skeleton(dtype)
        model = FullyShardedDataParallel(skeleton, comm=comm, auto_wrap_policy=ModuleWrapPolicy({self.task.block_class}),
                                         param_init_fn=skeleton.init_module, device=device)
        # PretrainedError, on every rank alike, if it does not fit; the file holds the vocabulary's real rows only
        load_pretrained(model, self.directory, rows=skeleton.checkpoint_rows())
        return model.eval()


def quantized_int8(model: nn.Module) -> nn.Module:
    """`model`, changed in place: torch's dynamic int8 quantization of its Linear layers (Conv1D made Linear first).

    A Linear whose weight is tied to an embedding (GPT-2's lm_head, BERT's masked-LM
    decoder) stays fp32: quantizing it would add an int8 copy beside the fp32 table
    the embedding still needs, and the model would grow.
    """
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, Conv1D):
                setattr(module, name, child.to_linear())
    names_of = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(param), []).append(name)
    untied = {name for name, module in model.named_modules()
              if isinstance(module, nn.Linear) and len(names_of[id(module.weight)]) == 1}
    with warnings.catch_warnings():  # torch marks torch.ao.quantization deprecated in favour of torchao, whose
        warnings.simplefilter("ignore")  # CPU int8 path ran 30x slower than fp32 here (docs/adapters.md)
        return torch.ao.quantization.quantize_dynamic(model, untied, dtype=torch.qint8, inplace=True)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the tensors that define `model`, each once: parameters, buffers, and the int8
    weights and biases that dynamically quantized Linear layers keep outside their parameters."""
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    for module in model.modules():
        if isinstance(module, DynamicQuantizedLinear):
            for tensor in (module.weight(), module.bias()):
                total += 0 if tensor is None else tensor.numel() * tensor.element_size()
    return total


@torch.no_grad()
def forward_latencies(task, model: nn.Module, comm: Communicator, device: torch.device, batch_size: int,
                      seconds: float) -> list[float]:
    """Seconds per forward pass (with the loss) of `batch_size` validation samples on every rank, the slowest rank's."""
    first = comm.rank * batch_size
    indices = torch.arange(first, first + batch_size) % len(task.val)
    batch = to_device(task.val.batch(indices, 0), device)
    latencies = []
    for repeat in range(WARM_UP + MAX_TIMED):
        comm.barrier()
        start = time.perf_counter()
        task.sample_losses(model, batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = comm.all_reduce_max_float(time.perf_counter() - start)  # the same on every rank: they stop together
        if repeat >= WARM_UP:
            latencies.append(elapsed)
        if len(latencies) >= MIN_TIMED and sum(latencies) >= seconds:
            break
    return latencies


def evaluate_precision(run: SavedRun, precision: str, args, comm: Communicator, device: torch.device) -> list[dict]:
    """The CSV rows of one precision: its quality once, then its timing at batch 1 and at --batch-size."""
    world, task = comm.world_size, run.task
    if precision == "int8" or world == 1:
        model = run.whole()
        model = quantized_int8(model) if precision == "int8" else model.to(device, PRECISIONS[precision])
        size = weight_bytes(model)
    else:
        size = weight_bytes(run.skeleton(PRECISIONS[precision]))
        model = run.sharded(PRECISIONS[precision], comm, device)
    if comm.rank == 0:
        print(f"{precision}: {size / 2**20:.2f} MiB of weights; validating", flush=True)
    quality = evaluate(task, model, args.batch_size, args.val_steps, run.seed, comm, device)
    model.eval()  # evaluate() hands the model back in training mode
    val_samples = len(task.val) if not args.val_steps else min(len(task.val), args.val_steps * args.batch_size * world)
    trained = run.description.get("trained", {})
    rows = []
    for batch_size in sorted({1, args.batch_size}):
        latencies = forward_latencies(task, model, comm, device, batch_size, args.timing_seconds)
        p50, p90, p99 = numpy.percentile(latencies, [50, 90, 99]) * 1000
        rows.append({
            "run_id": trained.get("run_id", run.directory.name), "experiment": run.experiment,
            "model": task.model_name, "parameters": run.parameters,
            "trained_strategy": trained.get("strategy", ""), "world_size": world, "threads_per_rank": args.threads,
            "device": device.type, "precision": precision, "size_mb": round(size / 2**20, 4),
            "val_samples": val_samples, **quality, "batch_size": batch_size, "seq_len": task.seq_len,
            "latency_p50_ms": round(p50, 3), "latency_p90_ms": round(p90, 3), "latency_p99_ms": round(p99, 3),
            "tokens_per_s": round(world * batch_size * task.seq_len * len(latencies) / sum(latencies), 1),
            "timed_passes": len(latencies), "git_commit": run.git_commit,
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        })
    return rows


def _set_up(args, comm: Communicator, local_rank: int):
    """(run, device, precisions, None) or (None, None, None, error message)."""
    try:
        precisions = [p.strip() for p in args.precisions.split(",") if p.strip()]
        unknown = [p for p in precisions if p not in PRECISIONS]
        if unknown or not precisions:
            raise UsageError(f"--precisions: unknown {', '.join(unknown) or '(none given)'}; choose from "
                             f"{', '.join(PRECISIONS)}")
        if args.batch_size < 1 or args.threads < 1 or args.val_steps < 0 or not args.timing_seconds > 0:
            raise UsageError("--batch-size and --threads must be at least 1, --val-steps at least 0, "
                             "--timing-seconds positive")
        torch.set_num_threads(args.threads)
        device = pick_device(args.device, local_rank)
        if device.type != "cpu" and "int8" in precisions:
            raise UsageError("int8 dynamic quantization runs on CPU only: leave int8 out of --precisions on a GPU, "
                             "or evaluate with --device cpu")
        return SavedRun(args, comm), device, precisions, None
    except UNUSABLE_RUN as failure:
        return None, None, None, str(failure)


def main() -> int:
    """Exit code 0, or 2 for a missing, incomplete or mismatched run directory or bad options (on every rank)."""
    argument_parser = parser()
    args = argument_parser.parse_args()
    comm = communicator_for_the_run(argument_parser.prog)
    if comm is None:
        return 2
    local_rank, _ = node_placement(comm)  # here, on every rank: set-up runs on rank 0 alone first
    values, error = set_up_rank_0_first(lambda: _set_up(args, comm, local_rank), comm)
    if error:
        if comm.rank == 0:
            print(f"{argument_parser.prog}: error: {error}", file=sys.stderr)
        return 2
    run, device, precisions = values
    announce_devices(device, comm)
    if comm.world_size > 1:
        abort_job_on_uncaught_exception(comm.mpi_comm)
    rows = []
    for precision in precisions:
        try:  # the same files on every rank: a model that does not fit fails on all of them alike
            rows += evaluate_precision(run, precision, args, comm, device)
        except (PretrainedCheckpointError, PretrainedError) as failure:
            if comm.rank == 0:
                print(f"{argument_parser.prog}: error: {failure}", file=sys.stderr)
            return 2
    if comm.rank == 0:
        report(rows, Path(args.out_dir) / f"eval-{rows[0]['run_id']}-n{comm.world_size}.csv")
    return 0


def report(rows: list[dict], path: Path) -> None:
    """Prints the table (the columns that have values) and writes every column to the CSV at `path`."""
    import pandas as pd

    writer = CsvWriter(path, EVAL_COLUMNS)
    for row in rows:
        writer.add(row)
    writer.finish()
    shown = ["precision", "batch_size", "size_mb", "val_loss", "val_perplexity", "val_mlm_accuracy",
             "val_nsp_accuracy", "latency_p50_ms", "latency_p90_ms", "latency_p99_ms", "tokens_per_s"]
    table = pd.DataFrame(rows)[[c for c in shown if c in rows[0]]]
    first = rows[0]
    print(f"\n{first['experiment']} {first['model']} ({first['parameters']:,} parameters), "
          f"{first['val_samples']:,} validation samples, {first['world_size']} rank(s) x {first['threads_per_rank']} "
          f"thread(s) on {first['device']}, sequences of {first['seq_len']} tokens")
    print(markdown(table))
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())

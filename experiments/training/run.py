"""One experiment from its command line to its CSV: start-up on every rank, then our training loop (``loop``) or
Lightning's (``lightning_runner``), and the exit code.

An experiment supplies a *task* (``run_gpt2.GPT2Task``, ``run_bert.BertTask``):
its datasets (``train``, ``val``: ``len()`` and ``batch(indices, epoch)``),
``seq_len``, ``block_class`` (the wrap unit), ``model_name``, ``build_model()``,
``sample_losses(model, batch)`` (one loss per sample), ``eval_sums(model, batch)``
(sums to add over ranks), ``val_columns(sums)`` (the CSV's validation columns) and,
optionally, ``save_extras(directory)`` (files to keep beside a saved model) and
``training_flops_per_token(model)`` (when it runs less of the model than all of it).
"""

import argparse
import signal
import sys

import torch

from corpora.files import DataError
from training.choices import TORCH_DISTRIBUTED
from training.keep_going import Left, survivors
from training.loop import train
from training.options import RunConfig, UsageError, check_checkpoint_options, check_config
from training.resume import ResumeError
from training.startup import (allow_tf32, announce_devices, communicator_for_the_run, pick_device,
                              set_up_rank_0_first)
from training.strategies import node_placement, torch_backend

from fsdp_mpi import (CheckpointError, Communicator, StopSignals, abort_job_on_uncaught_exception,
                      exit_without_finalize, is_newcomer)
from fsdp_mpi.communication.failures.job import place_on_node
from fsdp_mpi_models.checkpoint import PretrainedCheckpointError


def main(task_type, config_type: type[RunConfig], parser: argparse.ArgumentParser, experiment: str) -> int:
    """Runs one experiment under mpiexec; returns the exit code, the same on every rank.

    `task_type` is built from the `config_type` (RunConfig or an experiment's subclass) that `parser` gives.

    2: bad input or an unusable checkpoint; resume.STOPPED_WITH_CHECKPOINT (3) and
    STOPPED_WITHOUT_CHECKPOINT (4): stopped by SIGTERM or SIGUSR1 between two optimizer steps.
    """
    options = parser.parse_args()
    check_checkpoint_options(parser, options)
    config = config_type.from_namespace(options)
    comm = communicator_for_the_run(parser.prog)
    if comm is None:
        return 2
    stop = listen_for_stop_signals(config.strategy)
    if is_newcomer():  # started in a lost rank's place (--grow-back): the others are in their recovery, so alone
        *values, error = _set_up(task_type, config, comm, place_on_node(comm.rank))
        if error:
            print(f"{parser.prog}: error: the newcomer in rank {comm.rank}'s place: {error}", file=sys.stderr)
            exit_without_finalize(2)
    else:
        node = node_placement(comm)  # here, on every rank: set-up runs on rank 0 alone first
        values, error = set_up_rank_0_first(lambda: _set_up(task_type, config, comm, node), comm)
        if error:
            if comm.rank == 0:
                print(f"{parser.prog}: error: {error}", file=sys.stderr)
            return 2
    task, device = values
    if not is_newcomer():
        announce_devices(device, comm)
    if comm.world_size > 1:
        abort_job_on_uncaught_exception(comm.mpi_comm)
    if device.type == "cuda":  # before anything makes a CUDA context: else it is made on GPU 0, by every rank
        torch.cuda.set_device(device)
    stopped = None
    if config.strategy.startswith("lightning"):
        from training.lightning_runner import train_with_lightning  # imports Lightning: only when it trains

        path = train_with_lightning(task, config, comm, device, experiment)
    else:
        try:
            path, stopped = train(task, config, comm, device, experiment, stop)
        except (CheckpointError, ResumeError) as failure:  # raised on every rank alike
            if (survivors() or comm).rank == 0:  # after a loss: rank 0 of the ranks still training speaks
                print(f"{parser.prog}: error: {failure}", file=sys.stderr, flush=True)
            return _ended(2)
    if isinstance(stopped, Left):
        print(f"rank {comm.rank}: {stopped.message()}", flush=True)
    elif path is not None:  # the rank that wrote it: rank 0 of the ranks that finished
        print(f"wrote {path}" + (" (the epochs completed so far)" if stopped else ""))
        if stopped:
            print(stopped.message(), flush=True)
    return _ended(stopped.exit_code if stopped else 0)


def _ended(code: int) -> int:
    """`code`, returned to end the process as usual, or, after a lost rank, the process ended with it at once,
    without ``MPI_Finalize`` (fsdp_mpi.exit_without_finalize)."""
    if survivors() is not None:
        exit_without_finalize(code)
    return code


def _set_up(task_type, config: RunConfig, comm: Communicator, node: tuple[int, int]):
    """(task, device, None) or (None, None, error message) for input this machine cannot run.

    `node`: this rank's place on its node and the node's rank count (``strategies.node_placement``).
    """
    try:
        check_config(config)
        torch.set_num_threads(config.threads)
        local_rank, ranks_on_node = node
        device = pick_device(config.device, local_rank)
        allow_tf32(device)
        gpus = torch.cuda.device_count() if device.type == "cuda" else 0
        if (config.strategy in TORCH_DISTRIBUTED and torch_backend(config.backend, device) == "nccl"
                and ranks_on_node > gpus):
            raise UsageError(f"{config.strategy} communicates through nccl, which cannot share a GPU between ranks: "
                             f"this node runs {ranks_on_node} ranks on {gpus} visible GPU(s). Start one rank per "
                             "GPU, or use --backend fsdp_mpi, fsdp-mpi or lightning-fsdp-mpi, which can share one")
        if config.strategy == "lightning-fsdp" and device.type != "cuda":
            raise UsageError("lightning-fsdp needs a GPU (Lightning's FSDP does not run on CPU); "
                             "use fsdp-mpi, torch-fsdp or lightning-ddp here")
        if config.strategy == "lightning-fsdp" and config.save_dir:
            raise UsageError("--save-dir is not supported with lightning-fsdp (its weights stay sharded in "
                             "Lightning's layout); train with fsdp-mpi or torch-fsdp to save the model")
        if config.strategy == "lightning-fsdp-mpi" and config.precision == "16-mixed":
            raise UsageError("lightning-fsdp-mpi trains in 32 or bf16-mixed (fp16 loss scaling is not wired into "
                             "its Lightning strategy); fsdp-mpi itself has 16-mixed")
        if config.strategy.startswith("lightning") and config.precision == "16-mixed" and device.type != "cuda":
            raise UsageError("Lightning has no fp16 mixed precision on CPU (it would train in bf16-mixed "
                             "instead); use --precision bf16-mixed here")
        return task_type(config, comm), device, None
    except (DataError, UsageError, PretrainedCheckpointError, ValueError) as failure:
        return None, None, str(failure)


def listen_for_stop_signals(strategy: str) -> StopSignals:
    """Our training loop stops between optimizer steps on SIGTERM or SIGUSR1.

    Lightning's loop cannot: there SIGUSR1 (the hpc/ scripts' warning before the time
    limit) is ignored, so that the run goes on until the limit, and SIGTERM ends it as usual.
    """
    if strategy.startswith("lightning"):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        return StopSignals()
    return StopSignals().install()

"""One strategy's share of ``bench.py``: time training steps of GPT-2 or BERT on synthetic tokens, on the CPU or a GPU.

Launched by bench.py and predict.py (``launch.bench_worker``) as ``mpiexec -n N python -m
measuring.bench_worker --strategy S ...``; rank 0 writes the measurements as JSON. Per step: the
slowest rank's wall time, the busiest rank's CPU time (user + system, all its threads), the time a
rank spent blocked in MPI (fsdp-mpi only) and the bytes of the step's collectives: counted by
fsdp-mpi's communicator, counted at torch.distributed's Python entry points for torch FSDP2 (in one
extra, untimed step), and for DDP (whose reducer calls C++ directly) the gradient bytes its
all-reduces carry. On a GPU (``--device cuda``: each rank takes the GPU of its place on the node) a
step ends when the GPU has finished it, MFU is against the GPU's published dense peak for the
compute dtype, and the peak GPU memory per rank is reported beside the host's.
"""

import argparse
import json
import socket
import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from measuring import bench_models, bench_plan
from measuring.breakdown import StepBreakdown
from measuring.reported import PARTS, median_of_known
from training.choices import BACKENDS, PRECISIONS
from training.recipe import adamw
from training.results import (job_peak_flops, model_state_bytes, peak_resident_bytes, peak_rss_mb,
                              reset_peak_resident)
from training.startup import allow_tf32
from training.strategies import Prepared, compression_from_option, node_placement, prepare, torch_amp

from fsdp_mpi import (Communicator, CPUOffload, ShardingStrategy, abort_job_on_uncaught_exception,
                      step_in_backward, use_sample_dropout)


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", required=True, choices=bench_plan.BENCHED)
    parser.add_argument("--model", default="gpt2-seed")
    parser.add_argument("--vocab-size", type=int, default=None, help="default: the model's own")
    parser.add_argument("--layers", type=int, default=None, help="default: the model's own")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--overlap", default="", help="fsdp-mpi options to switch on, '+'-separated")
    parser.add_argument("--sharding-strategy", default="FULL_SHARD", choices=[s.name for s in ShardingStrategy],
                        help="fsdp-mpi's (default: %(default)s)")
    parser.add_argument("--hybrid-group-size", type=int, default=None, help="fsdp-mpi's HYBRID_SHARD group")
    parser.add_argument("--precision", default="32", choices=list(PRECISIONS))
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--backend", default="auto", choices=BACKENDS, help="torch.distributed's, for ddp and "
                                                                           "torch-fsdp")
    parser.add_argument("--json", required=True)
    return parser.parse_args()


def train_step(prepared: Prepared, optimizer, batch, in_backward: bool = False) -> None:
    """One optimizer step; `in_backward` (+step_in_backward): taken inside backward, unit by unit."""
    with prepared.autocast():
        loss = prepared.model(*batch)[-1]  # GPT-2's (logits, loss), BERT's (masked-LM, NSP logits, loss)
    if in_backward:  # no loss scaling to apply: the plan refuses it with fp16
        with step_in_backward(prepared.model, optimizer):
            loss.backward()
        return
    prepared.scaler.scale(loss).backward()
    prepared.scaler.step(optimizer)
    prepared.scaler.update()
    optimizer.zero_grad(set_to_none=True)


def timed_steps(prepared: Prepared, optimizer, batch, args, comm: Communicator, device: torch.device,
                breakdown: StepBreakdown | None = None, in_backward: bool = False):
    """Per step after warm-up: (slowest rank's wall time, the latest rank's time to issue the step, busiest
    rank's CPU time, this rank's time blocked in MPI, its bytes moved by collectives, the slowest rank's step in
    ``reported.PARTS`` if a `breakdown` is installed); then the slowest rank's first step, warm-up or not (where
    the model is compiled, the compile is in it), and this rank's peak resident memory over the timed steps
    (``step_peak``: the kernel's high-water mark, started again at the first: what the process held then, or
    the most it grew to since) and over its life so far (the reset clears what ``getrusage`` reports too);
    `in_backward`: the optimizer steps inside backward
    (``train_step``). fsdp-mpi trains over `comm` itself, so the step's
    figures are read before the timing's own collectives on it.

    A step is issued when the host has handed all of it to the device, before waiting for the GPU to run it
    (on a CPU: the step itself). Issued close to its wall time, a GPU step is bound by the host, not the GPU."""
    times, issued, cpu, blocked, moved, parts = [], [], [], [], [], []
    for index in range(args.warmup + args.steps):
        comm.barrier()
        if index == args.warmup:  # the timed steps' peak: settled steps, not the build's or the first's
            before = peak_resident_bytes()
            reset_peak_resident()
        mpi_before, bytes_before = prepared.comm_seconds(), prepared.comm_bytes()
        if breakdown:
            breakdown.start_step()
        cpu_start, start = time.process_time(), time.perf_counter()
        train_step(prepared, optimizer, batch, in_backward)
        issued_seconds = time.perf_counter() - start
        if device.type == "cuda":  # the step has ended when the GPU has run it
            torch.cuda.synchronize(device)
        seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
        recorded = breakdown.end_step() if breakdown else None
        blocked.append(prepared.comm_seconds() - mpi_before)
        moved.append(prepared.comm_bytes() - bytes_before)
        every_rank = comm.all_gather_object((seconds, issued_seconds))
        seconds_by_rank = [each for each, _ in every_rank]
        times.append(max(seconds_by_rank))
        issued.append(max(each for _, each in every_rank))
        cpu.append(max(comm.all_gather_object(cpu_seconds)))
        if breakdown:
            mine = breakdown.parts(recorded, seconds, blocked[-1], comm)
            parts.append(comm.all_gather_object(mine)[seconds_by_rank.index(times[-1])])
    step_peak = peak_resident_bytes()
    return (*(measured[args.warmup:] for measured in (times, issued, cpu, blocked, moved, parts)), times[0],
            step_peak, max(before, step_peak))


# torch.distributed's collectives and the argument that holds the full buffer (an all-gather's output,
# a reduce-scatter's input), counted as fsdp-mpi's communicator counts its own
FULL_BUFFER_ARGUMENT = {"all_gather_single": "output_tensor", "all_gather_into_tensor": "output_tensor",
                        "reduce_scatter_single": "input", "reduce_scatter_tensor": "input", "all_reduce": "tensor"}


@contextmanager
def counting_torch_collectives():
    """Counts the bytes of the collectives called through torch.distributed's Python functions (torch FSDP2
    calls them; DDP's C++ reducer does not); yields a one-element list holding the count."""
    import inspect

    import torch.distributed as dist

    counted = [0]
    originals = {name: getattr(dist, name) for name in FULL_BUFFER_ARGUMENT if hasattr(dist, name)}

    def counting(name, original):
        signature = inspect.signature(original)

        def collective(*args, **kwargs):
            full = signature.bind(*args, **kwargs).arguments[FULL_BUFFER_ARGUMENT[name]]
            counted[0] += full.numel() * full.element_size()
            return original(*args, **kwargs)
        return collective

    for name, original in originals.items():
        setattr(dist, name, counting(name, original))
    try:
        yield counted
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)


def lightning_steps(model, batch, args, comm: Communicator):
    """The same steps through a Lightning Trainer with DDP (gloo), timed by a callback: every step's wall and CPU
    time (the warm-up's too), the optimizer and the trained module."""
    import lightning as L
    from lightning.pytorch.plugins.environments import MPIEnvironment
    from lightning.pytorch.strategies import DDPStrategy

    class Steps(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model

        def training_step(self, item, _index):
            return self.model(*item)[-1]

        def configure_optimizers(self):
            return adamw(self.parameters(), lr=1e-4)

        def train_dataloader(self):
            return DataLoader(RepeatedBatch(), batch_size=None)

    class RepeatedBatch(Dataset):
        def __len__(self):
            return args.warmup + args.steps

        def __getitem__(self, _index):
            return batch

    class StepTimer(L.Callback):
        def __init__(self):
            self.times, self.cpu = [], []

        def on_train_batch_start(self, trainer, module, *_):
            comm.barrier()
            self.cpu_start, self.start = time.process_time(), time.perf_counter()

        def on_train_batch_end(self, trainer, module, *_):
            self.times.append(max(comm.all_gather_object(time.perf_counter() - self.start)))
            self.cpu.append(max(comm.all_gather_object(time.process_time() - self.cpu_start)))

    timer = StepTimer()
    module = Steps()
    trainer = L.Trainer(accelerator="cpu", devices=comm.world_size, num_nodes=1, max_epochs=1, precision=args.precision,
                        strategy=DDPStrategy(cluster_environment=MPIEnvironment(), process_group_backend="gloo"),
                        logger=False, enable_checkpointing=False, enable_model_summary=False,
                        enable_progress_bar=False, use_distributed_sampler=False, callbacks=[timer])
    trainer.fit(module)
    return timer.times, timer.cpu, trainer.optimizers[0], module


def link_bytes_sent() -> int:
    """Bytes this host has sent through its network interfaces (loopback aside), as the kernel counts them."""
    return sum(int((device / "statistics" / "tx_bytes").read_text())
               for device in Path("/sys/class/net").iterdir() if device.name != "lo")


def bytes_each_node_sends(step, comm: Communicator, first_on_node: bool) -> list[int]:
    """The bytes each host sends to the others while `step()` runs on every rank, read from its interfaces'
    counters by its first rank. The counter is read before the barrier: once a rank has left it, the other
    ranks on its host may already be sending. The barriers add a few hundred bytes."""
    before = link_bytes_sent() if first_on_node else 0
    comm.barrier()
    step()
    comm.barrier()
    sent = comm.all_gather_object(link_bytes_sent() - before if first_on_node else None)
    return [count for count in sent if count is not None]


def node_link_bytes_per_step(prepared: Prepared, optimizer, batch, comm: Communicator) -> float | None:
    """Where the ranks span several hosts: the bytes each host sent to the others in one (untimed) step,
    the mean over hosts; else None."""
    if len(set(comm.all_gather_object(socket.gethostname()))) == 1:
        return None
    sent = bytes_each_node_sends(lambda: train_step(prepared, optimizer, batch), comm,
                                 first_on_node=comm.split(None).rank == 0)
    return sum(sent) / len(sent)


def gradient_bytes(model) -> int:
    """What DDP all-reduces per step: every gradient, in the parameters' dtype (fp32 here)."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)


@dataclass
class Measured:
    """One run's figures per timed step (``timed_steps`` says what each holds) and what it trained."""

    times: list[float]
    issued: list[float]
    cpu: list[float]
    blocked: list[float]
    moved: list[int]
    parts: list[dict]
    first_step: float  # the slowest rank's first step, warm-up or not: a compiled model's includes its compile
    model: nn.Module  # as wrapped, not compiled: the model state to count
    optimizer: torch.optim.Optimizer
    link_bytes: float | None = None  # each host's bytes to the others in one step, where the ranks span hosts
    step_peak: int | None = None  # this rank's peak resident bytes over the timed steps (``timed_steps``)
    process_peak: int | None = None  # and over the process's life (None: read it from getrusage)


def set_up(args) -> tuple[Communicator, torch.device]:
    """The ranks' communicator and this rank's device (on a GPU: the one of its place on its node)."""
    comm = Communicator()
    if comm.world_size > 1:  # a rank that raises ends the job, rather than leaving the others in a collective
        abort_job_on_uncaught_exception(comm.mpi_comm)
    torch.set_num_threads(args.threads)
    device = torch.device("cpu")
    if args.device == "cuda":
        device = torch.device("cuda", node_placement(comm)[0] % torch.cuda.device_count())
        torch.cuda.set_device(device)
    allow_tf32(device)  # as training does: what stays fp32 runs on TF32 tensor cores
    comm.barrier()
    return comm, device


def wrapped(model, block_class: type, args, comm: Communicator, device: torch.device, options: tuple[str, ...],
            sharding: str) -> Prepared:
    """`model` on `device` under the strategy: plain torch's own, or ``strategies.prepare``'s with fsdp-mpi's
    options (+mpi and +flat aside: bench.py set their variables)."""
    if args.strategy == "plain":
        model.to(device)
        autocast, scaler = torch_amp(device.type, args.precision)
        return Prepared(model, lambda: 0.0, None, None, shards_gradients=False, scaler=scaler,
                        all_reduce_max=float, autocast=autocast)  # one process: its own value
    fsdp_options = dict.fromkeys((option for option in options if option in bench_plan.OVERLAP), True)
    given = bench_plan.compressions(options)  # comm=WEIGHTS[/GRADIENTS], the last if several
    fsdp_options["compression"] = compression_from_option(given[-1] if given else "none")
    if bench_plan.OFFLOAD in options:  # fsdp-mpi's CPUOffload, or FSDP2's CPUOffloadPolicy (strategies.prepare)
        fsdp_options["cpu_offload"] = CPUOffload(offload_params=True)
    if args.strategy == "fsdp-mpi":
        fsdp_options.update(sharding_strategy=ShardingStrategy[sharding], hybrid_group_size=args.hybrid_group_size)
    return prepare(args.strategy, model, block_class, device, comm, args.precision, args.backend, **fsdp_options)


def torch_run(model, batch, args, comm: Communicator, device: torch.device, options: tuple[str, ...],
              sharding: str) -> Measured:
    """Wraps `model` for the strategy, compiles it if an option says so, and times its steps."""
    block_class = bench_models.unit_class(model)
    if bench_plan.SAMPLE_DROPOUT in options:  # as the experiments train: each sample's masks from its keys
        use_sample_dropout(model, seed=0).set_batch(0, torch.arange(args.batch_size) + comm.rank * args.batch_size)
    breakdown = None
    if args.strategy == "fsdp-mpi" and bench_plan.COMPILE_WHOLE not in options:  # compiled whole: no hook is timed
        breakdown = StepBreakdown()
        breakdown.install()
    prepared = wrapped(model, block_class, args, comm, device, options, sharding)
    trained = prepared.model
    if bench_plan.COMPILE in options:  # each block in place, after wrapping: its gather and free stay eager
        for module in trained.modules():
            if isinstance(module, block_class):
                module.compile()
    if bench_plan.COMPILE_WHOLE in options:  # the whole (wrapped) model: fsdp-mpi's gathers and reductions traced
        prepared.model = torch.compile(prepared.model)
    optimizer = adamw(trained.parameters(), lr=1e-4)  # fused where torch has it, for every strategy alike
    if args.strategy == "torch-fsdp":  # counted in an extra untimed step: counting costs timed steps nothing
        with counting_torch_collectives() as torch_bytes:
            train_step(prepared, optimizer, batch)
    times, issued, cpu, blocked, moved, parts, first, step_peak, process_peak = timed_steps(
        prepared, optimizer, batch, args, comm, device, breakdown, bench_plan.STEP_IN_BACKWARD in options)
    if args.strategy == "torch-fsdp":
        moved = torch_bytes
    elif args.strategy == "ddp":
        moved = [gradient_bytes(model)]
    return Measured(times, issued, cpu, blocked, moved, parts, first, trained, optimizer,
                    node_link_bytes_per_step(prepared, optimizer, batch, comm), step_peak, process_peak)


def lightning_run(model, batch, args, comm: Communicator) -> Measured:
    """Times the steps of a Lightning Trainer with DDP (``lightning_steps``)."""
    every_step, every_cpu, optimizer, trained = lightning_steps(model, batch, args, comm)
    times, cpu = every_step[args.warmup:], every_cpu[args.warmup:]
    # Lightning runs on the CPU here, where a step is issued when it ends
    return Measured(times, times, cpu, [float("nan")], [gradient_bytes(model)], [], every_step[0], trained, optimizer)


def reported_figures(measured: Measured, comm: Communicator, device: torch.device) -> dict:
    """What the ranks report together (collectives: every rank calls this): the busiest rank's model state and
    peak memory, and the median rank's time blocked in MPI."""
    state_bytes = max(comm.all_gather_object(model_state_bytes(measured.model, measured.optimizer)))
    process_peak = peak_rss_mb() if measured.process_peak is None else measured.process_peak / 2**20
    rss = max(comm.all_gather_object(process_peak))
    step_peaks = comm.all_gather_object(measured.step_peak)
    step_rss = max(step_peaks) / 2**20 if None not in step_peaks else None
    on_gpu = device.type == "cuda"
    gpu_bytes = torch.cuda.max_memory_allocated(device) + comm.device_bytes_outside_torch() if on_gpu else 0
    gpu_mb = max(comm.all_gather_object(gpu_bytes / 2**20))  # torch's peak and the node transport's slots
    blocked = statistics.median(comm.all_gather_object(statistics.median(measured.blocked)))
    return {"peak_rss_mb": rss, "step_peak_rss_mb": step_rss, "peak_gpu_mb": gpu_mb if on_gpu else None,
            "model_state_mb": state_bytes / 2**20, "mpi_blocked_s": blocked}


def main() -> None:
    args = arguments()
    comm, device = set_up(args)
    job_peak = job_peak_flops(comm, device, args.precision)  # every GPU in use once, or every rank's cores
    torch.manual_seed(0)
    model = bench_models.build(args.model, args.vocab_size, args.layers)
    flops_per_token = bench_models.flops_per_token(model, args.seq_len)
    parameters = model.num_parameters()
    batch = bench_models.synthetic_batch(model, args.batch_size, args.seq_len, comm.rank, device)
    options = bench_plan.worker_options(args.overlap)
    sharding = bench_plan.sharding(options) or args.sharding_strategy
    if args.strategy == "lightning-ddp":
        measured = lightning_run(model, batch, args, comm)
    else:
        measured = torch_run(model, batch, args, comm, device, options, sharding)
    figures = reported_figures(measured, comm, device)
    if comm.rank == 0:
        step = statistics.median(measured.times)
        tokens_per_s = args.batch_size * args.seq_len * comm.world_size / step
        with open(args.json, "w") as f:
            json.dump({
                "strategy": "+".join([args.strategy, *options,
                                      *([f"backend={args.backend}"] if args.backend != "auto" else [])]),
                "sharding_strategy": sharding if args.strategy == "fsdp-mpi" else None,
                "precision": args.precision, "ranks": comm.world_size, "parameters": parameters,
                "step_s": step, "step_times_s": measured.times, "first_step_s": measured.first_step,
                "issued_s": statistics.median(measured.issued),
                "cpu_s": statistics.median(measured.cpu), "tokens_per_s": tokens_per_s,
                "tflops": tokens_per_s * flops_per_token / 1e12, "mfu": tokens_per_s * flops_per_token / job_peak,
                **figures, "comm_mb_per_step": statistics.median(measured.moved) / 2**20,
                "link_mb_per_step": None if measured.link_bytes is None else measured.link_bytes / 2**20,
                # the slowest rank's step, part by part (fsdp-mpi only): each part's median over the timed steps
                **{part: median_of_known([each[part] for each in measured.parts]) for part in PARTS},
            }, f)


if __name__ == "__main__":
    main()

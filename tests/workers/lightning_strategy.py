"""FSDPMPIStrategy under a Lightning Trainer on N ranks against plain torch in one process (see test_lightning.py).

Every run trains the same tiny regression model on a fixed dataset of 16 samples
on 2 ranks, 8 per rank per step: a DistributedSampler without shuffling gives rank r
the samples r, r + 2, ..., so each step's global batch is the whole dataset, and the
reference trains on it in one process. One step per epoch also keeps a resumed run
on the same data whichever batch of an epoch Lightning resumes at.
Checkpoints are written both ways (Lightning's one file, the default, and shards), resumed, and
loaded through the strategy as Lightning would, to see that Lightning's weights_only reaches the
state's loading; the one file also loads in Lightning alone. The fitted module is validated again.
Last, a batch job's requeue signal stops the run after a step and the requeued Trainer resumes it.
Writes a JSON report.
"""

import json
import os
import shutil
import signal
import sys
import warnings
from pathlib import Path, PurePosixPath

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fsdp_mpi import STOPPED_WITH_CHECKPOINT, CheckpointError, Compression, CPUOffload, full_state_dict
from fsdp_mpi.sharding.state_dict import sharded_parameters
from fsdp_mpi.lightning import LIGHTNING_STATE_FILE, FSDPMPIPrecision, FSDPMPIStrategy

SAMPLES, PER_RANK, WIDTH, LR, MOMENTUM = 16, 8, 8, 0.1, 0.9


class Block(nn.Module):
    compute_dtypes: list[str] = []  # the weight's dtype in each forward (gathered, in the compute dtype)

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        Block.compute_dtypes.append(str(self.linear.weight.dtype))
        return torch.tanh(self.linear(x))


def dataset(samples: int = SAMPLES) -> TensorDataset:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(samples, WIDTH, generator=generator)
    return TensorDataset(inputs, inputs.sum(dim=1, keepdim=True).sin())


def network() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block(), nn.Linear(WIDTH, 1))


class Regression(L.LightningModule):
    per_rank = PER_RANK  # samples in a rank's batch: a micro-batch where the Trainer accumulates
    moves_to_cpu = 0  # calls of .cpu(): Lightning's teardown makes one unless the strategy keeps the shards in place

    def __init__(self):
        super().__init__()
        self.net = network()

    def cpu(self):
        Regression.moves_to_cpu += 1
        return super().cpu()

    def training_step(self, batch, _index):
        inputs, targets = batch
        # Under bf16-mixed the root unit casts the whole batch, targets too: both sides in fp32 (docs/api.md)
        return nn.functional.mse_loss(self.net(inputs).float(), targets.float())

    def forward(self, inputs):
        return self.net(inputs)

    def validation_step(self, batch, _index):
        inputs, targets = batch
        self.log("val_loss", nn.functional.mse_loss(self.net(inputs), targets), sync_dist=True)  # mean of ranks'

    def train_dataloader(self):
        """Lightning would put in a shuffling DistributedSampler; this one keeps the order (from the strategy's
        num_replicas and rank)."""
        data = dataset()
        sampler = DistributedSampler(data, shuffle=False, **self.trainer.strategy.distributed_sampler_kwargs)
        return DataLoader(data, batch_size=self.per_rank, sampler=sampler)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=MOMENTUM)


def trainer(max_steps: int, strategy: FSDPMPIStrategy | None = None, **options) -> L.Trainer:
    return L.Trainer(accelerator="cpu", devices=MPI.COMM_WORLD.Get_size(), max_steps=max_steps,
                     strategy=strategy or FSDPMPIStrategy(auto_wrap_policy={Block}), use_distributed_sampler=False,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     **{"enable_checkpointing": False, **options})


def trained_weights(module: Regression, fitted: L.Trainer) -> dict:
    state = full_state_dict(fitted.strategy.model, rank0_only=True)
    return {name.removeprefix("net."): tensor for name, tensor in state.items()}


def reference(steps: int, clip: float | None) -> tuple[dict, list[float]]:
    """Plain torch in this process: (weights after `steps` global batches, the gradient norm before each clip)."""
    model = network()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    inputs, targets = dataset().tensors
    global_batch = PER_RANK * MPI.COMM_WORLD.Get_size()
    norms = []
    for step in range(steps):
        rows = slice(step * global_batch % SAMPLES, step * global_batch % SAMPLES + global_batch)
        optimizer.zero_grad()
        nn.functional.mse_loss(model(inputs[rows]), targets[rows]).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else float("inf"))))
        optimizer.step()
    return model.state_dict(), norms


def max_difference(weights: dict, expected: dict) -> float:
    assert sorted(weights) == sorted(expected), (sorted(weights), sorted(expected))
    return max(float((weights[name] - expected[name]).abs().max()) for name in expected)


def weights_only_handed_on(strategy: FSDPMPIStrategy, checkpoint: str, kind: str) -> dict:
    """Loads a copy of `checkpoint` (a file, or a directory of shards) whose Lightning state also holds a path
    object (harmless, but more than a weights_only load builds) through the strategy, as Lightning would: with its
    default weights_only and with weights_only=False. Each rank's refusal message, and what the unsafe load gave
    and warned, in rank order, under `kind`_..."""
    comm = MPI.COMM_WORLD
    source = Path(checkpoint)
    copy = source.with_name(f"with-a-path-{kind}.ckpt")
    state_file = copy / LIGHTNING_STATE_FILE if source.is_dir() else copy
    if comm.Get_rank() == 0:
        shutil.copytree(source, copy) if source.is_dir() else shutil.copy2(source, copy)
        state = torch.load(state_file, weights_only=True)
        torch.save({**state, "note": PurePosixPath("trusted")}, state_file)
    comm.Barrier()
    try:
        strategy.load_checkpoint(copy)
        refusal = None
    except CheckpointError as error:
        refusal = str(error)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        note = str(strategy.load_checkpoint(copy, weights_only=False)["note"])
    unsafe_warnings = sum("weights_only=False" in str(warning.message) for warning in caught)
    # Through a Trainer, as a user resumes: Lightning hands fit's weights_only on to the strategy.
    trusting = trainer(4, FSDPMPIStrategy(auto_wrap_policy={Block}, state_dict_type=kind))
    try:
        trusting.fit(Regression(), ckpt_path=copy, weights_only=False)
        trusted = trusting.global_step
    except CheckpointError as error:
        trusted = str(error)
    return {f"{kind}_refusals": comm.allgather(refusal), f"{kind}_unsafe_notes": comm.allgather(note),
            f"{kind}_unsafe_warnings": comm.allgather(unsafe_warnings), f"{kind}_trusted_resume": trusted}


def file_optimizer_is_the_shards(checkpoint: str, strategy: FSDPMPIStrategy) -> bool:
    """Whether the momentum in a one-file checkpoint, cut where this rank's shards are, is theirs bit for bit."""
    saved = torch.load(checkpoint, weights_only=True)["optimizer_states"][0]["state"]
    optimizer = strategy.optimizers[0]
    return all(torch.equal(saved[p.names[0]]["momentum_buffer"].reshape(-1)[slice(*p.handle.part_held(p.slot))],
                           optimizer.state[p.view]["momentum_buffer"])
               for p in sharded_parameters(strategy.model))


def validated_again(fitted: L.Trainer, module: Regression) -> dict:
    """The fitted Trainer validates the same module (its second setup wraps the shards again): the loss it logs,
    the same loss computed through the wrapped model outside Lightning, and whether the weights stayed; a
    Trainer asking for other settings (bf16) is refused."""
    comm = MPI.COMM_WORLD
    before = trained_weights(module, fitted)
    data = dataset()
    loader = DataLoader(data, batch_size=PER_RANK, sampler=DistributedSampler(
        data, shuffle=False, **fitted.strategy.distributed_sampler_kwargs))
    logged = float(fitted.validate(module, loader, verbose=False)[0]["val_loss"])
    inputs, targets = (tensor[comm.Get_rank()::comm.Get_size()] for tensor in data.tensors)
    with torch.no_grad():
        local = float(nn.functional.mse_loss(fitted.strategy.model(inputs), targets))
    after = trained_weights(module, fitted)
    try:
        trainer(1, precision="bf16-mixed").validate(module, loader, verbose=False)
        refusal = None
    except ValueError as error:
        refusal = str(error)
    return {"validated_loss": logged, "outside_lightning_loss": sum(comm.allgather(local)) / comm.Get_size(),
            "validated_weights_kept": comm.Get_rank() != 0 or max_difference(after, before) == 0.0,
            "settings_refusal": refusal}


def optimizer_built_before_sharding() -> str | None:
    """What fit says of an optimizer that configure_optimizers hands over ready-made, built from the module's
    parameters before the Trainer sharded it (it would step tensors that no longer train)."""
    module = Regression()
    early = torch.optim.SGD(module.parameters(), lr=LR)
    module.configure_optimizers = lambda: early
    try:
        trainer(1).fit(module)
    except ValueError as error:
        return str(error)
    return None


class SignalRankOneInStepTwo(Callback):
    """SLURM's warning as it may land: on one rank only, in the middle of a step (before its first micro-batch)."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == 1 and batch_idx == 0 and trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGUSR1)


def requeued_after_a_signal(root: str) -> dict:
    """Lightning's SLURM auto-requeue under the strategy, in a batch job as sbatch describes it (SLURM_JOB_ID,
    SLURM_NTASKS, a job name) with an ``scontrol`` on PATH that notes its arguments, each step accumulating two
    micro-batches: the requeue signal reaches rank 1 alone before step 2's first (of 4 steps); what each rank's
    fit ended with and after which step, the requeue calls, the files saved; then the requeued job's Trainer,
    given no checkpoint, resumes by itself: its last step and its weights' difference from the same run never
    stopped. Last in the worker: it leaves SLURM's variables set."""
    comm = MPI.COMM_WORLD
    Regression.per_rank = PER_RANK // 2
    never_stopped, module = trainer(4, accumulate_grad_batches=2), Regression()
    never_stopped.fit(module)
    expected = trained_weights(module, never_stopped)
    folder = Path(root) / "requeue"
    calls = folder / "scontrol-calls"
    if comm.Get_rank() == 0:
        (folder / "bin").mkdir(parents=True)
        scontrol = folder / "bin" / "scontrol"
        scontrol.write_text(f'#!/bin/sh\necho "$@" >> {calls}\n')
        scontrol.chmod(0o755)
    comm.Barrier()
    os.environ.update(SLURM_JOB_ID="4242", SLURM_NTASKS=str(comm.Get_size()), SLURM_JOB_NAME="train",
                      PATH=f"{folder / 'bin'}{os.pathsep}{os.environ['PATH']}")
    stopped = trainer(4, default_root_dir=folder, callbacks=[SignalRankOneInStepTwo()], accumulate_grad_batches=2)
    try:
        stopped.fit(Regression())
        exit_code = None
    except SystemExit as stop:
        exit_code = stop.code
    handler_after = signal.getsignal(signal.SIGUSR1)
    comm.Barrier()
    resumed, module = trainer(4, default_root_dir=folder, accumulate_grad_batches=2), Regression()
    resumed.fit(module)
    weights = trained_weights(module, resumed)
    report = {"requeue_exit_codes": comm.allgather(exit_code), "requeue_stopped_after": comm.allgather(stopped.global_step),
              "requeue_handler_restored": comm.allgather(handler_after is signal.SIG_DFL),
              "requeue_files": sorted(path.name for path in folder.glob("hpc_ckpt_*")),
              "requeue_resumed_global_step": resumed.global_step}
    if comm.Get_rank() == 0:
        report["requeue_calls"] = calls.read_text().splitlines() if calls.exists() else []
        report["requeue_resumed_difference"] = max_difference(weights, expected)
    return {**report, **requeued_under_fit_elastic(folder, expected)}


def requeued_under_fit_elastic(folder: Path, expected: dict) -> dict:
    """The same under ``fit_elastic`` saving every 3 steps (here, where MPI cannot report a lost rank, it fits as
    usual): the requeue's checkpoint is fit_elastic's, at the step of the stop, and the next ``fit_elastic``
    resumes from it: what fit ended with, the directory's latest checkpoint, the resumed run's last step and its
    weights' difference from the run never stopped."""
    from fsdp_mpi.lightning_elastic import fit_elastic

    comm = MPI.COMM_WORLD
    checkpoints = folder / "elastic"  # and the Trainers' root: the folder above holds the hpc file of the run before

    def build(on, signalled: bool):
        return (trainer(4, FSDPMPIStrategy(auto_wrap_policy={Block}, comm=on), default_root_dir=checkpoints,
                        accumulate_grad_batches=2, callbacks=[SignalRankOneInStepTwo()] if signalled else []),
                Regression())

    try:
        fit_elastic(lambda on: build(on, True), checkpoints, 3)
        exit_code = None
    except SystemExit as stop:
        exit_code = stop.code
    comm.Barrier()
    latest = (checkpoints / "latest").read_text().strip()
    fitted = fit_elastic(lambda on: build(on, False), checkpoints, 3)
    weights = trained_weights(fitted.lightning_module, fitted)
    report = {"elastic_requeue_exit_codes": comm.allgather(exit_code), "elastic_requeue_latest": latest,
              "elastic_requeue_resumed_global_step": fitted.global_step}
    if comm.Get_rank() == 0:
        report["elastic_requeue_resumed_difference"] = max_difference(weights, expected)
        report["elastic_requeue_calls"] = (folder / "scontrol-calls").read_text().splitlines()  # both cases'
    return report


def main(out_path: str, checkpoint_dir: str) -> None:
    comm = MPI.COMM_WORLD
    report, finals, strategies = {}, {}, {}
    # The unclipped run checkpoints in Lightning's one file ("full", the default), the clipped one in shards.
    for name, clip, kind in (("unclipped", None, "full"), ("clipped", 0.05, "sharded")):
        module = Regression()
        saving = ModelCheckpoint(f"{checkpoint_dir}/{kind}", filename="{epoch}", save_top_k=-1)
        fitted = trainer(4, FSDPMPIStrategy(auto_wrap_policy={Block}, state_dict_type=kind),
                         gradient_clip_val=clip, callbacks=[saving], enable_checkpointing=True)
        fitted.fit(module)
        finals[name] = weights = trained_weights(module, fitted)
        strategies[name] = fitted.strategy
        if comm.Get_rank() == 0:
            expected, norms = reference(4, clip)
            report[f"{name}_max_difference"] = max_difference(weights, expected)
            report[f"{name}_gradient_norms"] = norms
            report[f"{name}_scale"] = max(float(t.abs().max()) for t in expected.values())
        if name == "unclipped":
            report.update(validated_again(fitted, module))
    strategy = strategies["unclipped"]
    report["precision_plugin"] = type(strategy.precision_plugin).__name__
    report["moves_to_cpu"] = Regression.moves_to_cpu  # after two fits (on a GPU such a move is refused)
    value = torch.tensor([comm.Get_rank() + 1.0])
    report["reduce_sum"] = float(strategy.reduce(value, reduce_op="sum"))
    report["reduce_mean"] = float(strategy.reduce(value))
    report["reduce_max_min"] = [float(strategy.reduce(value, reduce_op=op)) for op in ("max", "min")]
    report["all_gather"] = strategy.all_gather(value).flatten().tolist()
    report["broadcast"] = strategy.broadcast(f"from {comm.Get_rank()}", src=comm.Get_size() - 1)
    report["early_optimizer"] = optimizer_built_before_sharding()

    # The one-file checkpoint after the last step: Lightning's own loader reads it in one process, without
    # fsdp_mpi, as the trained weights; its optimizer state, cut where each rank's shards are, is theirs.
    last = f"{checkpoint_dir}/full/epoch=3.ckpt"
    report["full_checkpoint_is_a_file"] = Path(last).is_file()
    if comm.Get_rank() == 0:
        loaded = Regression.load_from_checkpoint(last).state_dict()
        report["full_loaded_difference"] = max_difference({name.removeprefix("net."): tensor
                                                           for name, tensor in loaded.items()}, finals["unclipped"])
    report["full_optimizer_is_the_shards"] = comm.allgather(file_optimizer_is_the_shards(last, strategy))

    # Resume each run from the checkpoint its ModelCheckpoint wrote after its first epoch in a fresh Trainer,
    # the one-file one offloaded (on a CPU the same path, its copies free): the same weights as the run that
    # went on.
    for name, clip, kind, options in (("unclipped", None, "full", {"cpu_offload": CPUOffload(offload_params=True)}),
                                      ("clipped", 0.05, "sharded", {"state_dict_type": "sharded"})):
        resumed = trainer(4, FSDPMPIStrategy(auto_wrap_policy={Block}, **options), gradient_clip_val=clip)
        module = Regression()
        resumed.fit(module, ckpt_path=f"{checkpoint_dir}/{kind}/epoch=0.ckpt")
        weights = trained_weights(module, resumed)
        report[f"{kind}_resumed_global_step"] = resumed.global_step
        if comm.Get_rank() == 0:
            report[f"{kind}_resumed_difference"] = max_difference(weights, finals[name])
        report.update(weights_only_handed_on(resumed.strategy, f"{checkpoint_dir}/{kind}/epoch=0.ckpt", kind))

    module = Regression()
    Block.compute_dtypes.clear()
    bf16 = trainer(1, precision="bf16-mixed")
    bf16.fit(module)
    report["bf16_plugin"] = type(bf16.strategy.precision_plugin).__name__
    report["bf16_compute_dtypes"] = sorted(set(Block.compute_dtypes))
    report["bf16_master_dtypes"] = sorted({str(p.dtype) for p in module.parameters()})
    assert isinstance(bf16.strategy.precision_plugin, FSDPMPIPrecision)

    # Compressed communication through the strategy's keyword arguments: one step gathers int8 weights and
    # reduces int8 gradients by an all-to-all (no reduce-scatter), and lands near the uncompressed step.
    compressed = trainer(1, FSDPMPIStrategy(auto_wrap_policy={Block}, compression=Compression("int8", "int8")))
    module = Regression()
    compressed.fit(module)
    report["compressed_operations"] = sorted(op for op, count in compressed.strategy.comm.bytes_moved.items() if count)
    plain = trainer(1)
    reference_module = Regression()
    plain.fit(reference_module)
    near, exact = trained_weights(module, compressed), trained_weights(reference_module, plain)
    if comm.Get_rank() == 0:
        report["compressed_difference"] = max_difference(near, exact)
        report["compressed_scale"] = max(float(t.abs().max()) for t in exact.values())
    report.update(requeued_after_a_signal(checkpoint_dir))
    report["stopped_with_checkpoint"] = STOPPED_WITH_CHECKPOINT
    if comm.Get_rank() == 0:
        with open(out_path, "w") as out:
            json.dump(report, out)


if __name__ == "__main__":
    main(*sys.argv[1:])

"""The PyTorch Lightning baselines: the same task, data, optimizer and CSV, trained by a Lightning Trainer.

mpiexec starts the processes; Lightning's ``MPIEnvironment`` reads rank and
world size from MPI and sets up torch.distributed (gloo on CPU, nccl on GPU).
"""

import time

import lightning as L
import torch
from lightning.pytorch.plugins.environments import MPIEnvironment
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from mpi4py import MPI
from torch.utils.data import DataLoader, Dataset

from results import model_state_bytes
from training import RunRecorder, build_model, epoch_steps, evaluate


class _EpochSteps(Dataset):
    """One epoch's steps for this rank: each item is a whole batch with its loss weight."""

    def __init__(self, samples, steps, epoch: int):
        self.samples, self.steps, self.epoch = samples, steps, epoch

    def __len__(self) -> int:
        return len(self.steps)

    def __getitem__(self, step: int):
        indices, weight, step_total = self.steps[step]
        return self.samples.batch(indices, self.epoch), weight, step_total


class TaskModule(L.LightningModule):
    def __init__(self, task, model: torch.nn.Module, args, comm: MPI.Comm):
        super().__init__()
        self.task, self.model, self.args, self.comm = task, model, args, comm
        self.loss_sum, self.samples = 0.0, 0

    def train_dataloader(self):
        steps = list(epoch_steps(len(self.task.train), self.args, self.comm, self.current_epoch, self.args.seed))
        return DataLoader(_EpochSteps(self.task.train, steps, self.current_epoch), batch_size=None, shuffle=False)

    def training_step(self, item, _index):
        batch, weight, step_total = item
        losses = self.task.sample_losses(self.model, batch)
        if weight:
            self.loss_sum += losses.sum().item()
        self.samples += int(step_total)
        return losses.sum() * weight

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.args.lr)


class _EpochRecorder(L.Callback):
    """Times each epoch, validates, and hands the figures to the shared RunRecorder."""

    def __init__(self, recorder: RunRecorder, device: torch.device):
        self.recorder, self.device = recorder, device
        self.start = 0.0

    def on_train_epoch_start(self, trainer, module):
        module.loss_sum, module.samples = 0.0, 0
        module.comm.Barrier()
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, module):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        module.comm.Barrier()
        seconds = time.perf_counter() - self.start
        train_loss = module.comm.allreduce(module.loss_sum, op=MPI.SUM) / module.samples
        val = evaluate(module.task, module.model, module.args, module.comm, self.device)
        if module.comm.Get_rank() == 0:
            print(f"epoch {trainer.current_epoch}: train loss {train_loss:.4f}, "
                  + ", ".join(f"{k} {v}" for k, v in val.items()) + f", {seconds:.1f} s", flush=True)
        state_bytes = model_state_bytes(module, trainer.optimizers[0])
        self.recorder.add_epoch(trainer.current_epoch, trainer.num_training_batches, module.samples, seconds,
                                train_loss, val, state_bytes, float("nan"), self.device)


def train_with_lightning(task, args, comm: MPI.Comm, device: torch.device, experiment: str):
    """Trains with ``lightning-ddp`` or ``lightning-fsdp`` (GPU only); returns the CSV path on rank 0."""
    model = build_model(task, args, comm)
    recorder = RunRecorder(task, args, comm, device, experiment, model)
    processes_per_node = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_size()
    environment = MPIEnvironment()
    if args.strategy == "lightning-ddp":
        strategy = DDPStrategy(cluster_environment=environment,
                               process_group_backend="nccl" if device.type == "cuda" else "gloo")
    else:
        strategy = FSDPStrategy(cluster_environment=environment, auto_wrap_policy={task.block_class})
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=processes_per_node,
        num_nodes=comm.Get_size() // processes_per_node, strategy=strategy, max_epochs=args.epochs,
        limit_train_batches=args.steps_per_epoch or 1.0, limit_val_batches=0, num_sanity_val_steps=0,
        reload_dataloaders_every_n_epochs=1, use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=not args.no_progress,
        callbacks=[_EpochRecorder(recorder, device)],
    )
    trainer.fit(TaskModule(task, model, args, comm))
    return recorder.finish()

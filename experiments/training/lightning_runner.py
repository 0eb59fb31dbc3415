"""The PyTorch Lightning baselines: the same task, data, recipe and CSV, trained by a Lightning Trainer.

mpiexec starts the processes; Lightning's ``MPIEnvironment`` reads rank and
world size from MPI. ``lightning-ddp`` and ``lightning-fsdp`` set up torch.distributed on ``--backend``
(gloo on CPU, nccl on GPU by default, or fsdp_mpi); ``lightning-fsdp-mpi`` (fsdp_mpi's ``FSDPMPIStrategy``)
needs none: everything goes through MPI. All three train the same ``TaskModule``.
Lightning accumulates gradients itself (``accumulate_grad_batches``), clips them
(``gradient_clip_val``), applies ``--precision`` (its own names: autocast, with a
loss scaler for 16-mixed) and steps the shared schedule after each optimizer step.
"""

import time
from contextlib import contextmanager

import lightning as L
import torch
from lightning.pytorch.plugins.environments import MPIEnvironment
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from torch.utils.data import DataLoader, Dataset

from training.evaluation import evaluate
from training.options import RunConfig
from training.recipe import optimizer_and_schedule
from training.recorder import RunRecorder
from training.results import model_state_bytes
from training.resume import EpochTally
from training.sampling import epoch_steps, total_optimizer_steps
from training.saved_run import save_trained
from training.strategies import build_model, compression_from_option, full_state_dict_on_rank0, torch_backend

from fsdp_mpi import Communicator, CPUOffload, SampleKeys, full_state_dict
from fsdp_mpi.lightning import FSDPMPIStrategy


class _EpochMicroBatches(Dataset):
    """One epoch's micro-batches for this rank, in order: each item is a whole batch with its loss weight, its
    samples over all ranks, its sample indices and the run's optimizer step it belongs to (dropout's keys)."""

    def __init__(self, samples, steps, epoch: int):
        self.samples, self.epoch = samples, epoch
        first = epoch * len(steps)  # every epoch has as many optimizer steps
        self.micro_batches = [(first + number, micro) for number, step in enumerate(steps) for micro in step]

    def __len__(self) -> int:
        return len(self.micro_batches)

    def __getitem__(self, index: int):
        step, micro = self.micro_batches[index]
        return self.samples.batch(micro.indices, self.epoch), micro.weight, micro.samples, micro.indices, step


class TaskModule(L.LightningModule):
    def __init__(self, task, model: torch.nn.Module, dropout_keys: SampleKeys, config: RunConfig, comm: Communicator):
        super().__init__()
        self.task, self.model, self.config, self.comm = task, model, config, comm
        self.dropout_keys = dropout_keys
        self.tally = EpochTally()  # the epoch's, started afresh by _EpochRecorder

    def train_dataloader(self):
        steps = epoch_steps(len(self.task.train), self.config.batching, self.comm, self.current_epoch,
                            self.config.seed)
        return DataLoader(_EpochMicroBatches(self.task.train, steps, self.current_epoch), batch_size=None,
                          shuffle=False)

    def forward(self, *args, **kwargs):
        """The task's model: evaluation calls it through the strategy's wrapper, which sharded strategies need
        (the root's own parameters are gathered around the wrapper's call)."""
        return self.model(*args, **kwargs)

    def training_step(self, item, index):
        batch, weight, samples, indices, step = item
        self.dropout_keys.set_batch(int(step), indices)
        losses = self.task.sample_losses(self.model, batch)
        if index % self.trainer.accumulate_grad_batches == 0:  # an optimizer step's first micro-batch
            self.tally.add_step(0.0, 0, self.comm.world_size)
        self.tally.step_loss_sums[-1] += losses.sum().item() if weight else 0.0
        self.tally.step_samples[-1] += int(samples)
        # Lightning divides what this returns by accumulate_grad_batches; the weight already averages over the step.
        return losses.sum() * weight * self.trainer.accumulate_grad_batches

    def configure_optimizers(self):
        config = self.config
        total_steps = total_optimizer_steps(len(self.task.train), config.batching, config.epochs, self.comm.world_size)
        # Lightning's mixed precision clips the gradients between backward and the optimizer's step, and refuses
        # an optimizer that unscales them only in its step, as fused AdamW does: such runs take AdamW's
        # multi-tensor form.
        fused = not (config.clip_norm and config.precision != "32")
        optimizer, schedule = optimizer_and_schedule(self, total_steps, config.lr, config.weight_decay,
                                                     config.warmup_steps, fused=fused)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        """Lightning refuses norm clipping under its FSDP; there the root FSDP module's ``clip_grad_norm_`` does it."""
        if not isinstance(self.trainer.strategy, FSDPStrategy):
            super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)
        elif gradient_clip_val:
            self.trainer.model.clip_grad_norm_(gradient_clip_val)


class _RankAlone(MPIEnvironment):
    """MPI's ranks, each on a node of its own with the one device the experiments chose for it: Lightning gives
    a node's k-th rank the node's k-th device, which cannot put two ranks on one GPU (fsdp_mpi's node-local
    choice when ranks outnumber GPUs); ranks and world size stay MPI's."""

    def local_rank(self) -> int:
        return 0

    def node_rank(self) -> int:
        return self.global_rank()


class _EpochRecorder(L.Callback):
    """Times each epoch, validates, and hands the figures to the shared RunRecorder."""

    def __init__(self, recorder: RunRecorder, device: torch.device):
        self.recorder, self.device = recorder, device
        self.start = 0.0

    def on_train_epoch_start(self, trainer, module):
        module.tally = EpochTally(comm_seconds=float("nan"))  # Lightning's communication time is not measured
        module.comm.barrier()
        self.start = time.perf_counter()

    def on_train_epoch_end(self, trainer, module):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        module.comm.barrier()
        tally, config = module.tally, module.config
        tally.seconds = time.perf_counter() - self.start
        step_loss_sums = torch.tensor(tally.step_loss_sums, dtype=torch.float64)  # (steps,) this rank's, then all's
        module.comm.all_reduce_sum_(step_loss_sums)
        tally.step_loss_sums = step_loss_sums.tolist()
        val = evaluate(module.task, trainer.strategy.model, config.batch_size, config.val_steps, config.seed,
                       module.comm, self.device, trainer.precision_plugin.forward_context)
        self.recorder.add_epoch(trainer.current_epoch, trainer.global_step - tally.steps, tally, val,
                                model_state_bytes(module, trainer.optimizers[0]), self.device)


class _FSDPStrategyNoSync(FSDPStrategy):
    """Lightning's FSDP for --accum-no-sync: gradients stay unsharded and unreduced until a step's last micro-batch.

    Lightning calls ``block_backward_sync`` around the micro-batches it accumulates;
    its own FSDP strategy does nothing there (it reduce-scatters every micro-batch).
    """

    @contextmanager
    def block_backward_sync(self):
        with self.model.no_sync():
            yield


def train_with_lightning(task, config: RunConfig, comm: Communicator, device: torch.device, experiment: str):
    """Trains with ``lightning-ddp``, ``lightning-fsdp`` (GPU only) or ``lightning-fsdp-mpi``; returns the CSV
    path on rank 0. `comm` carries the runner's own collectives (timing, validation, the CSV rows); Lightning's
    strategies make theirs (FSDPMPIStrategy over a Communicator of its own)."""
    model, dropout_keys = build_model(task, config.seed, comm)
    recorder = RunRecorder(task, config, comm, device, experiment, model, config.batching)
    environment = _RankAlone()
    if config.strategy == "lightning-ddp":
        strategy = DDPStrategy(cluster_environment=environment,
                               process_group_backend=torch_backend(config.backend, device))
    elif config.strategy == "lightning-fsdp-mpi":
        strategy = FSDPMPIStrategy(auto_wrap_policy={task.block_class}, accumulate_without_sync=config.accum_no_sync,
                                   cluster_environment=environment,
                                   compression=compression_from_option(config.comm_compression),
                                   cpu_offload=CPUOffload(offload_params=True) if config.cpu_offload else None)
    else:
        fsdp = _FSDPStrategyNoSync if config.accum_no_sync else FSDPStrategy
        strategy = fsdp(cluster_environment=environment, auto_wrap_policy={task.block_class},
                        process_group_backend=torch_backend(config.backend, device))
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu", devices=[device.index] if device.type == "cuda" else 1,
        num_nodes=comm.world_size, strategy=strategy, max_epochs=config.epochs,
        precision=config.precision, accumulate_grad_batches=config.grad_accum,
        gradient_clip_val=config.clip_norm or None,
        gradient_clip_algorithm="norm", limit_val_batches=0, num_sanity_val_steps=0,
        reload_dataloaders_every_n_epochs=1, use_distributed_sampler=False, logger=False,
        enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=not config.no_progress,
        callbacks=[_EpochRecorder(recorder, device)],
    )
    trainer.fit(TaskModule(task, model, dropout_keys, config, comm))
    if config.save_dir:  # --save-dir is refused for lightning-fsdp
        if config.strategy == "lightning-fsdp-mpi":  # the whole TaskModule was wrapped: its names start with "model."
            state = full_state_dict(trainer.strategy.model, rank0_only=True)
            state = {name.removeprefix("model."): tensor for name, tensor in state.items()} if state else None
        else:  # DDP trained `model` in place, whole on every rank
            state = full_state_dict_on_rank0(config.strategy, model, comm)
        save_trained(task, state, config, recorder.fixed)
    return recorder.finish()

"""fsdp_mpi as a PyTorch Lightning strategy: ``Trainer(strategy=FSDPMPIStrategy(...))`` under mpiexec or srun.

    trainer = L.Trainer(strategy=FSDPMPIStrategy(auto_wrap_policy={Block}), precision="bf16-mixed",
                        gradient_clip_val=1.0, accumulate_grad_batches=4)
    trainer.fit(module)            # mpiexec -n 4 python train.py

The launcher starts the processes; ranks are those of the strategy's communicator (all of MPI's by default;
``CommEnvironment``) and no torch.distributed group is created: every collective,
the strategy's own (barrier, broadcast, metric reductions) included, goes
through fsdp_mpi's ``Communicator``, so the hang watch covers them too. The whole LightningModule is wrapped in one
``FullyShardedDataParallel`` root, and Lightning calls ``training_step`` and
``validation_step`` through it, so the root's parameters are gathered around
each step; call the model through the module (``self(...)`` or inside a step),
not a submodule on its own.

What each Lightning feature becomes:
    precision            "32-true", or "bf16-mixed": bf16 gathers and compute over fp32
                         master shards (``MixedPrecision``), not autocast
    gradient_clip_val    the global norm over every rank's shards (``clip_grad_norm_``);
                         clipping by value is refused (it would be applied per shard alike,
                         but Lightning's algorithm names promise the unsharded semantics)
    accumulate_grad_batches  gradients reduce-scattered after every micro-batch (1/N of
                         them kept); ``accumulate_without_sync=True`` keeps them whole and
                         unreduced until the last micro-batch instead
    checkpoints          Lightning's own file, the whole weights and optimizer state gathered to
                         rank 0 (``state_dict_type="full"``, the default, as Lightning's FSDPStrategy),
                         or a directory: every rank's shards (``save_checkpoint``) and Lightning's own
                         state (loops, schedulers, callbacks) in ``lightning_state.pt`` ("sharded");
                         either resumable with ``ckpt_path=`` on any number of ranks, and loaded with
                         ``weights_only=True`` unless ``fit(..., weights_only=False)`` says otherwise
    SLURM auto-requeue   as Lightning's (its SLURMEnvironment's requeue_signal, SIGUSR1 by default): the
                         signal noted where it lands, and after the optimizer step whose end finds it on
                         any rank every rank saves hpc_ckpt_N.ckpt, rank 0 requeues the job, and the run
                         exits with code 3; the requeued job resumes from that file (lightning_requeue.py)
    a lost rank          ends the job, saying why (``CANNOT_GO_ON``): a Trainer cannot be rebuilt
                         on fewer ranks in the middle of ``fit``; under Open MPI's ULFM,
                         ``fsdp_mpi.lightning_elastic.fit_elastic`` builds a new one on the survivors
                         (or grown back) and resumes it from the latest checkpoint, in the same job
"""

import pickle
import re
import socket
import sys
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
from fsspec.utils import get_protocol
from lightning.pytorch.core.optimizer import _MockOptimizer
from lightning.pytorch.plugins.environments import ClusterEnvironment
from lightning.pytorch.plugins.precision import MixedPrecision as LightningMixedPrecision
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.enums import GradClipAlgorithmType
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only

from fsdp_mpi.files.checkpoint import CheckpointError, load_checkpoint, on_every_rank, save_checkpoint
from fsdp_mpi.files.optimizer_state import full_optimizer_state_dict, load_full_optimizer_state_dict
from fsdp_mpi.loop.clip import clip_grad_norm_
from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.failures.lost_ranks import RankLostError, can_go_on
from fsdp_mpi.elastic.agreement import end_step
from fsdp_mpi.lightning_requeue import RequeueAfterTheStep
from fsdp_mpi.sharding.fully_sharded import FullyShardedDataParallel
from fsdp_mpi.sharding.state_dict import full_state_dict, load_full_state_dict
from fsdp_mpi.sharding.mixed_precision import MixedPrecision
from fsdp_mpi.sharding.strategy import ShardingStrategy
from fsdp_mpi.sharding.torch_options import read_sharding_strategy
from fsdp_mpi.sharding.wrap import ModuleWrapPolicy, as_wrap_policy

LIGHTNING_STATE_FILE = "lightning_state.pt"  # beside the shards in a checkpoint directory
# Why a Trainer ends at a lost rank unless fit_elastic drives it: what a run on the survivors needs rebuilt lives
# in Lightning's objects (the fit loop's progress, callbacks, loggers, the samplers cut for N ranks, the module's
# references to the wrapped model and its optimizer), and fit() has no place to do it; fit_elastic builds a new
# Trainer on the survivors instead (lightning_elastic.py).
CANNOT_GO_ON = ("a Trainer cannot go on without a lost rank in the middle of fit() (its loops, callbacks, "
                "loggers and samplers would have to be rebuilt on the survivors): the job ends. To go on in the "
                "same job, build the Trainer in a function of the ranks and fit it under "
                "fsdp_mpi.lightning_elastic.fit_elastic (Open MPI with --with-ft ulfm); or resume from the last "
                "checkpoint with fit(ckpt_path=...) on the ranks you have")
_PRECISIONS = {"32-true": None, "bf16-mixed": torch.bfloat16}


def load_lightning_state(path: str | Path, weights_only: bool | None = None, warn: bool = True) -> dict:
    """Lightning's own state from `path` (a ``lightning_state.pt``), loaded as Lightning's `weights_only` says.

    ``None`` (Lightning's default) and ``True`` load with ``torch.load(weights_only=True)``, which builds only
    tensors and plain Python values, so nothing in the file can run code; what Lightning and this strategy
    write (loops, callbacks, schedulers, hyperparameters of plain types) needs nothing more. ``False`` is
    the user's word that the file is trusted: it is unpickled in full, after a warning (if `warn`: the strategy
    lets rank 0 alone warn, so that a job says it once) that this may run code.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: missing; a checkpoint of FSDPMPIStrategy is one file, or a directory of "
                              f"shards holding {LIGHTNING_STATE_FILE}")
    safe = weights_only is not False
    if not safe and warn:
        warnings.warn(f"{path}: loading with weights_only=False, as asked: unpickling it runs any code the file "
                      "holds, so do this only with files you trust", stacklevel=2)
    try:
        state = torch.load(path, map_location="cpu", weights_only=safe)
    except Exception as error:  # torch raises many types for damaged files
        if safe and isinstance(error, pickle.UnpicklingError):
            raise CheckpointError(_refusal(path, error)) from None
        raise CheckpointError(f"{path}: unreadable ({error})") from error
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: holds a {type(state).__name__}, not Lightning's state (a dict)")
    return state


def _refusal(path: Path, error: pickle.UnpicklingError) -> str:
    """Why torch's weights_only load refused `path` (the global it met, from torch's message), and the way out."""
    unsafe = re.search(r"GLOBAL ([\w.]+)", str(error))
    found = (f"this one would call or build {unsafe.group(1)}" if unsafe
             else "this one cannot be read that way (damaged, or not written by torch.save)")
    return (f"{path}: refused: a weights_only load builds only tensors and plain Python values, so that nothing "
            f"in the file can run code, and {found}. If you trust the file, pass weights_only=False to "
            "fit/validate/test/predict along with this ckpt_path")


class FSDPMPIPrecision(Precision):
    """Lightning's precision setting carried out by fsdp_mpi: ``MixedPrecision`` instead of autocast,
    and clipping by the global norm of the sharded gradients."""

    def __init__(self, precision: str = "32-true"):
        if precision not in _PRECISIONS:
            raise ValueError(f"FSDPMPIStrategy supports precision {' or '.join(map(repr, _PRECISIONS))}, "
                             f"not {precision!r} (fp16 loss scaling is not wired into Lightning here)")
        self.precision = precision
        self.sharded_module = None  # set by the strategy once it has wrapped the LightningModule
        self.step_agreement = None  # set by a strategy that keeps going: the step's agreement, before the update

    @property
    def mixed_precision(self) -> MixedPrecision | None:
        dtype = _PRECISIONS[self.precision]
        return MixedPrecision(param_dtype=dtype) if dtype else None

    def _after_closure(self, model, optimizer) -> None:
        """After the step's last backward and the clipping (collectives of the step), before the update: where a
        Trainer that keeps going ends each optimizer step in its one agreement (``elastic/agreement.py``), so
        that the weights change on every rank or on none."""
        super()._after_closure(model, optimizer)
        if self.step_agreement is not None:
            self.step_agreement()

    def clip_gradients(self, optimizer, clip_val=0.0, gradient_clip_algorithm=GradClipAlgorithmType.NORM) -> None:
        if clip_val <= 0:
            return
        if gradient_clip_algorithm != GradClipAlgorithmType.NORM:
            raise ValueError("FSDPMPIStrategy clips by norm only: use gradient_clip_algorithm='norm'")
        clip_grad_norm_(self.sharded_module, clip_val)


def _as_fsdp_mpi_precision(plugin: Precision | None) -> FSDPMPIPrecision | None:
    """The plugin Lightning chose from ``Trainer(precision=...)``, turned into ours (its autocast is not needed)."""
    if plugin is None or isinstance(plugin, FSDPMPIPrecision):
        return plugin
    if type(plugin) is Precision:
        return FSDPMPIPrecision("32-true")
    if isinstance(plugin, LightningMixedPrecision):
        return FSDPMPIPrecision(plugin.precision)
    raise ValueError(f"FSDPMPIStrategy cannot train with {type(plugin).__name__}: use precision '32-true' or "
                     "'bf16-mixed'")


def _is_local(path) -> bool:
    """Whether `path` names this machine's files, not a URL (``s3://...``) that fsspec reads."""
    return get_protocol(str(path)) in ("file", "local")


class CommEnvironment(ClusterEnvironment):
    """Lightning's view of the ranks: a ``Communicator``'s (MPI's whole world by default, the survivors of a loss
    under ``fit_elastic``), each rank's place on its node found once from the host names (one collective, as the
    strategy is made). No torch.distributed group is made, so there is no address or port to give."""

    def __init__(self, comm: Communicator):
        self.comm = comm
        hosts = comm.all_gather_object(socket.gethostname())
        here = hosts[comm.rank]
        self._local_rank = hosts[:comm.rank].count(here)
        self._node_rank = sorted(set(hosts)).index(here)

    @property
    def creates_processes_externally(self) -> bool:
        return True  # mpiexec or srun started them

    @property
    def main_address(self) -> str:
        return "localhost"  # unused: no torch.distributed group

    @property
    def main_port(self) -> int:
        return 0  # unused, as the address

    @staticmethod
    def detect() -> bool:
        return False  # only ever given by FSDPMPIStrategy

    def world_size(self) -> int:
        return self.comm.world_size

    def set_world_size(self, size: int) -> None:
        pass  # the communicator's

    def global_rank(self) -> int:
        return self.comm.rank

    def set_global_rank(self, rank: int) -> None:
        pass  # the communicator's

    def local_rank(self) -> int:
        return self._local_rank

    def node_rank(self) -> int:
        return self._node_rank


class FSDPMPIStrategy(ParallelStrategy):
    """Trains a LightningModule fully sharded over the MPI ranks.

    Args:
        auto_wrap_policy: the module classes that become sharding units (a set of classes, any fsdp_mpi wrap
            policy, or a callable in torch FSDP's form, as Lightning's FSDPStrategy takes); what is left belongs
            to the root unit.
        sharding_strategy: as ``FullyShardedDataParallel``'s (FULL_SHARD by default), or its name
            (``"HYBRID_SHARD"``), as Lightning's FSDPStrategy takes it.
        accumulate_without_sync: during gradient accumulation, reduce only on the step's last micro-batch.
        state_dict_type: how checkpoints are written, as Lightning's FSDPStrategy takes it. ``"full"`` (the
            default): one file, Lightning's own, with the whole weights and optimizer state by name, gathered to
            rank 0 a unit at a time: ``LightningModule.load_from_checkpoint`` reads it without fsdp_mpi.
            ``"sharded"``: a directory, every rank writing its shards at once (``save_checkpoint``), for models
            whose whole state rank 0's memory or one writer cannot carry. Either resumes on any number of ranks.
        comm: the ranks to train on (all of MPI's by default); ``fit_elastic`` passes its builder the survivors.
        fsdp_kwargs: passed on to ``FullyShardedDataParallel`` (e.g. ``forward_prefetch=True``).
    """

    strategy_name = "fsdp_mpi"

    def __init__(self, auto_wrap_policy=None, sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
                 accumulate_without_sync: bool = False, state_dict_type: str = "full", accelerator=None,
                 parallel_devices=None,
                 cluster_environment=None, precision_plugin: FSDPMPIPrecision | None = None,
                 comm: Communicator | None = None, **fsdp_kwargs):
        # MPI.COMM_WORLD by default, logged and watched like every collective of the layer
        self.comm = comm if comm is not None else Communicator()
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment or CommEnvironment(self.comm),
                         precision_plugin=precision_plugin)
        if isinstance(auto_wrap_policy, (set, frozenset, list, tuple)):
            auto_wrap_policy = ModuleWrapPolicy(set(auto_wrap_policy))
        # Read now, so that a bad one fails here rather than when the Trainer sets the model up.
        self.auto_wrap_policy = None if auto_wrap_policy is None else as_wrap_policy(auto_wrap_policy)
        self.sharding_strategy = read_sharding_strategy(sharding_strategy)
        self.accumulate_without_sync = accumulate_without_sync
        if state_dict_type not in ("full", "sharded"):
            raise ValueError(f"state_dict_type must be 'full' or 'sharded', not {state_dict_type!r}")
        self.state_dict_type = state_dict_type
        self.fsdp_kwargs = fsdp_kwargs
        self.keeps_going = False  # set by fit_elastic: every optimizer step ends in the ranks' agreement
        self._shards_to_load: Path | None = None  # a directory checkpoint whose shards load after sharding
        self._requeue: RequeueAfterTheStep | None = None  # SLURM's auto-requeue, while a fit trains
        self.requeue_saves = None  # set by fit_elastic: a requeue saves where it resumes (else Lightning's hpc file)

    # ------------------------------------------------------------- where and how many

    @property
    def root_device(self) -> torch.device:
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:  # Lightning then gives each rank its part of the data
        return True

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    @property
    def precision_plugin(self) -> FSDPMPIPrecision:
        if self._precision_plugin is None:
            self._precision_plugin = FSDPMPIPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        self._precision_plugin = _as_fsdp_mpi_precision(plugin)

    def setup_environment(self) -> None:
        if self.comm.world_size != self.world_size:
            raise RuntimeError(f"MPI has {self.comm.world_size} ranks but Lightning was set up for "
                               f"{self.world_size}: pass Trainer(devices=ranks per node, num_nodes=nodes)")
        if can_go_on() and not self.keeps_going and self.comm.rank == 0:  # launched to go on: say how
            print(f"fsdp_mpi.lightning: {CANNOT_GO_ON}", file=sys.stderr, flush=True)
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # the communicator's, after a loss too
        super().setup_environment()

    def on_train_start(self) -> None:
        """Lightning's SLURM auto-requeue, where its SLURMEnvironment asks for it: after an optimizer step, the same
        on every rank (lightning_requeue.py)."""
        self._requeue = RequeueAfterTheStep.added_to(self.lightning_module.trainer, self.comm, self.requeue_saves)

    def on_exception(self, exception: BaseException) -> None:
        """Lightning calls this with what ended fit(): a lost rank is said plainly (then the exception ends the
        job, as any other), unless ``fit_elastic`` goes on."""
        if isinstance(exception, RankLostError) and not self.keeps_going:
            print(f"fsdp_mpi.lightning: rank {self.comm.rank}: {exception}. {CANNOT_GO_ON}", file=sys.stderr,
                  flush=True)
        super().on_exception(exception)

    # ------------------------------------------------------------- the model

    def _setup_model(self, model):
        """Shards the LightningModule, or, where an earlier setup sharded it (``test()`` after ``fit()``, or
        another Trainer's), wraps its shards again: the same weights, sharded as this strategy says."""
        mixed_precision = self.precision_plugin.mixed_precision
        if not any(True for _ in model.parameters()):
            return model  # nothing to shard: it runs as it is, on every rank
        if FullyShardedDataParallel.is_sharded(model):
            wrapped = FullyShardedDataParallel.of_sharded(model, comm=self.comm,
                                                          sharding_strategy=self.sharding_strategy,
                                                          mixed_precision=mixed_precision or MixedPrecision())
        else:
            wrapped = FullyShardedDataParallel(model, comm=self.comm, auto_wrap_policy=self.auto_wrap_policy,
                                               sharding_strategy=self.sharding_strategy,
                                               mixed_precision=mixed_precision, device=self.root_device,
                                               **self.fsdp_kwargs)
        self.precision_plugin.sharded_module = wrapped
        self.precision_plugin.step_agreement = (lambda: end_step(self.comm)) if self.keeps_going else None
        fitting = self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        if self._shards_to_load is not None and not (fitting and self.lightning_restore_optimizer):
            load_checkpoint(self._shards_to_load, wrapped)  # no optimizer's to restore with them
            self._shards_to_load = None
        return wrapped

    def setup_optimizers(self, trainer) -> None:
        """Lightning's, then a check that every optimizer steps the sharded parameters: one built before the model
        was sharded (from the module's parameters then) would step tensors that no longer train, silently."""
        super().setup_optimizers(trainer)
        views = {id(param) for param in self.lightning_module.parameters()}
        for optimizer in self.optimizers:
            if isinstance(optimizer, _MockOptimizer):  # configure_optimizers gave none
                continue
            strangers = sum(id(param) not in views for group in optimizer.param_groups for param in group["params"])
            if strangers:
                raise ValueError(f"{type(optimizer).__name__} holds {strangers} parameters that are not the sharded "
                                 "model's: build the optimizer inside configure_optimizers, from self.parameters() "
                                 "(the model is sharded by then), not before the Trainer sets the model up")

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    def teardown(self) -> None:
        """Lightning's teardown less its move of the model and the optimizer's state to the CPU (how it frees a
        GPU after fit): a sharded module refuses to be moved (sharding/in_place.py), so its shards and their
        optimizer state stay on the device, as Lightning's own FSDPStrategy leaves them."""
        self._shards_to_load = None
        if self._requeue is not None:
            self._requeue.close()
            self._requeue = None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()
        self.checkpoint_io.teardown()

    @contextmanager
    def block_backward_sync(self):
        """Lightning enters this for the micro-batches of an optimizer step before its last."""
        if self.accumulate_without_sync and isinstance(self.model, FullyShardedDataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    # ------------------------------------------------------------- collectives, through MPI

    def barrier(self, name: str | None = None) -> None:
        self.comm.barrier()

    def broadcast(self, obj, src: int = 0):
        return self.comm.broadcast_object(obj, root=src)

    def reduce(self, tensor, group=None, reduce_op="mean"):
        """Averages (Lightning's default), sums, or takes the largest or smallest of a tensor over the ranks,
        element by element: a metric logged with ``sync_dist=True`` (and its ``reduce_fx``)."""
        if not isinstance(tensor, torch.Tensor):
            return tensor
        op = str(reduce_op).lower().rsplit(".", 1)[-1]
        if op not in ("mean", "avg", "sum", "max", "min"):
            raise ValueError(f"FSDPMPIStrategy reduces by mean, sum, max or min, not {reduce_op!r}")
        every = torch.stack(self.comm.all_gather_object(tensor.detach().cpu()))  # (ranks, *shape), in rank order
        if op in ("max", "min"):
            return getattr(every, op)(dim=0).values.to(tensor.device)
        total = every.to(torch.float64).sum(dim=0)
        total = total.to(tensor.device, tensor.dtype if tensor.is_floating_point() else torch.float64)
        return total / self.world_size if op in ("mean", "avg") else total

    def all_gather(self, tensor, group=None, sync_grads: bool = False):
        """(ranks, *tensor.shape): every rank's `tensor`, stacked in rank order."""
        if sync_grads:
            raise ValueError("FSDPMPIStrategy.all_gather does not carry gradients (sync_grads=True)")
        return torch.stack(self.comm.all_gather_object(tensor.detach().cpu())).to(tensor.device)

    # ------------------------------------------------------------- checkpoints: one file, or shards

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        """False, as for one device: Lightning restores before the model is sharded, passing on the user's
        `weights_only` (it drops it for strategies that restore after setup) and calling the hooks in its usual
        order. A file's weights load into the module, which sharding then cuts; a directory's shards load once
        the model is sharded (``_setup_model``), or in ``fit`` with the optimizer's, once it is built."""
        return False

    def _saves_shards(self) -> bool:
        """Whether a checkpoint is a directory of shards: "sharded", once there are shards to write."""
        return self.state_dict_type == "sharded" and FullyShardedDataParallel.is_sharded(self.lightning_module)

    def lightning_module_state_dict(self) -> dict:
        """One file: the unsharded weights under the LightningModule's names, on rank 0 (every rank gathers)."""
        if self._saves_shards():
            return {}
        if not FullyShardedDataParallel.is_sharded(self.lightning_module):  # before setup: the module's own
            return super().lightning_module_state_dict()
        return full_state_dict(self.lightning_module, rank0_only=True)

    def optimizer_state(self, optimizer) -> dict:
        """One file: the whole optimizer state by parameter name, on rank 0 (``full_optimizer_state_dict``)."""
        if self._saves_shards():
            return {}
        if not FullyShardedDataParallel.is_sharded(self.lightning_module) or isinstance(optimizer, _MockOptimizer):
            return super().optimizer_state(optimizer)
        return full_optimizer_state_dict(self.lightning_module, optimizer, rank0_only=True)

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """One file: rank 0 writes Lightning's checkpoint at `filepath`. Shards: a directory at `filepath`, the
        shards (every rank), then Lightning's own state (rank 0). A failure on any rank is raised on every rank."""
        if not self._saves_shards():
            on_every_rank(self.comm, lambda: self.checkpoint_io.save_checkpoint(
                checkpoint, filepath, storage_options=storage_options) if self.is_global_zero else None)
            return
        if not _is_local(filepath):
            raise ValueError(f"{filepath}: state_dict_type='sharded' writes a directory on this machine's files; "
                             "'full' writes one file wherever fsspec can")
        save_checkpoint(filepath, self.model, self._the_optimizer())
        state = {key: value for key, value in checkpoint.items() if key not in ("state_dict", "optimizer_states")}
        on_every_rank(self.comm, lambda: torch.save(state, Path(filepath) / LIGHTNING_STATE_FILE)
                      if self.is_global_zero else None)

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        """Lightning's checkpoint: a file (whichever ``state_dict_type`` wrote it, on any number of ranks, or
        Lightning without fsdp_mpi), or a directory of shards, whose shards load later (see
        ``restore_checkpoint_after_setup``).

        Lightning's state is read as `weights_only` says (``load_lightning_state``), before anything of the
        model changes; rank 0 alone warns about an unsafe load.
        """
        if not _is_local(checkpoint_path):  # a URL, to fsspec: Lightning's own reading of one file
            return super().load_checkpoint(checkpoint_path, weights_only)
        path = Path(checkpoint_path)
        if not path.exists():
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if path.is_file():
            return load_lightning_state(path, weights_only, warn=self.is_global_zero)
        state = load_lightning_state(path / LIGHTNING_STATE_FILE, weights_only, warn=self.is_global_zero)
        self._shards_to_load = path
        return {**state, "state_dict": {}, "optimizer_states": []}

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        """A file's weights into the module, or into its shards where an earlier setup sharded it."""
        module = self.lightning_module
        if not checkpoint["state_dict"]:
            return  # a directory: its shards load once the model is sharded
        if FullyShardedDataParallel.is_sharded(module):
            load_full_state_dict(module, checkpoint["state_dict"], strict=strict)
        else:
            module.load_state_dict(checkpoint["state_dict"], strict=strict)

    def load_optimizer_state_dict(self, checkpoint) -> None:
        """A directory's shards of the model and its optimizer; or a file's whole optimizer states, each rank
        keeping its pieces."""
        if self._shards_to_load is not None:
            load_checkpoint(self._shards_to_load, self.model, self._the_optimizer())
            self._shards_to_load = None
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):
            if state:
                load_full_optimizer_state_dict(self.model, optimizer, state)

    def _the_optimizer(self):
        if len(self.optimizers) > 1:
            raise ValueError("FSDPMPIStrategy(state_dict_type='sharded') checkpoints at most one optimizer; "
                             "'full' checkpoints any number")
        return self.optimizers[0] if self.optimizers else None

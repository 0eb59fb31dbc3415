"""FullyShardedDataParallel: the user-facing wrapper around one sharding unit.

The wrapper validates the model, makes every rank start from rank 0's weights,
applies the wrap policy (nested wrappers, bottom-up) and attaches a
``ShardedUnit`` to the module it wraps; the unit's hooks on that module do the
gathering and freeing (``lifecycle.py``). The wrapper itself is transparent:
attributes it lacks are the wrapped module's, ``named_parameters()`` gives the
original names, and ``state_dict()`` is the unsharded model's.
"""

import sys
from contextlib import contextmanager

import torch
from torch import nn

from fsdp_mpi.communication.comm import Communicator
from fsdp_mpi.communication.compression import Compression
from fsdp_mpi.communication.failures.abort import abort_job_on_uncaught_exception
from fsdp_mpi.communication.failures.job import job_comm
from fsdp_mpi.communication.routes import report_route_once
from fsdp_mpi.sharding.deferred_init import is_deferred, materialize_into_shards
from fsdp_mpi.sharding.host_memory import give_back_freed_host_memory, keep_freed_host_memory_for_reuse
from fsdp_mpi.sharding.lifecycle import (UNIT_ATTRIBUTE, WRAPPED_MODULE, Overlap, ShardedUnit, modules_outside_units,
                                original_name, units_with_names)
from fsdp_mpi.sharding.mixed_precision import MixedPrecision
from fsdp_mpi.sharding.offload import CPUOffload
from fsdp_mpi.sharding.state_dict import full_state_dict, load_full_state_dict
from fsdp_mpi.sharding.strategy import ShardGroups, ShardingStrategy
from fsdp_mpi.sharding.traced import (eager_as_a_frame_of_its_own, gather_in_graph, mark_eager_frames_for_dynamo,
                                      release_in_graph)
from fsdp_mpi.sharding.torch_options import read_cpu_offload, read_mixed_precision, read_sharding_strategy
from fsdp_mpi.sharding.validation import check_module_can_be_sharded, check_same_model_on_all_ranks
from fsdp_mpi.sharding.wrap import apply_wrap_policy, as_wrap_policy


class FullyShardedDataParallel(nn.Module):
    """Shards `module`'s parameters, gradients and optimizer state over the ranks of `comm`.

    Args:
        module: the model (or part of it) to shard. It must be built identically on every rank.
        comm: an mpi4py communicator or a ``fsdp_mpi.Communicator``; ``MPI.COMM_WORLD`` by default.
        auto_wrap_policy: e.g. ``ModuleWrapPolicy({Block})``: which submodules become nested units; a policy
            written for torch's FSDP (a callable ``(module, recurse, nonwrapped_numel) -> bool``) works too.
        sharding_strategy: ``FULL_SHARD`` (default), ``SHARD_GRAD_OP``, ``HYBRID_SHARD`` or ``NO_SHARD``
            (see ``strategy.py``). torch FSDP's ``ShardingStrategy``, ``MixedPrecision`` and ``CPUOffload`` are
            read as ours (``torch_options.py``).
        hybrid_group_size: under ``HYBRID_SHARD``, ranks per shard group (consecutive ranks); by default
            ``FSDP_MPI_HYBRID_GROUP_SIZE``, else the ranks of each node.
        mixed_precision: ``MixedPrecision(param_dtype=torch.bfloat16)`` gathers and computes in bf16
            over fp32 master shards (see ``mixed_precision.py``). None: everything in the parameters' dtype.
        compression: ``Compression(weights="int8", gradients="bf16")`` gathers weights and reduces gradients
            in fewer bytes, whatever dtype the module computes in (see ``compression.py``). None: uncompressed.
        device: where the unit computes; the module is moved there (under ``cpu_offload``, its buffers only).
            Defaults to the parameters' device. ``device_id``: torch FSDP's name for it.
        cpu_offload: ``CPUOffload(offload_params=True)`` keeps the shards, their gradients and so the
            optimizer state in host memory, each unit's shard copied to `device` for its gather
            (see ``offload.py``). None: all on `device`.
        sync_module_states: broadcast rank 0's parameters and buffers first, so every rank starts identical
            (for a model on the meta device: rank 0's random generator state before initialising).
        param_init_fn: for a model built on the ``meta`` device, ``param_init_fn(module)`` initialises
            `module`'s own parameters, one module at a time (``deferred_init.py``); by default each
            module's ``reset_parameters()``. The shards are created on `device` (CPU by default).
        forward_prefetch: start the next unit's all-gather when a unit's forward starts.
        backward_prefetch: start the all-gather of the unit whose backward comes next.
        async_reduce_scatter: let a unit's gradient reduce-scatter complete while earlier units' backward runs.
    """

    def __init__(
        self,
        module: nn.Module,
        *,
        comm=None,
        auto_wrap_policy=None,
        sharding_strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD,
        mixed_precision: MixedPrecision | None = None,
        compression: Compression | None = None,
        device: torch.device | str | int | None = None,
        device_id: torch.device | str | int | None = None,
        cpu_offload: CPUOffload | None = None,
        sync_module_states: bool = True,
        forward_prefetch: bool = False,
        backward_prefetch: bool = False,
        async_reduce_scatter: bool = False,
        param_init_fn=None,
        hybrid_group_size: int | None = None,
        _groups: ShardGroups | None = None,
    ):
        super().__init__()
        if isinstance(module, FullyShardedDataParallel) or UNIT_ATTRIBUTE in getattr(module, "__dict__", {}):
            raise ValueError("this module is already wrapped by FullyShardedDataParallel; wrap it only once "
                             "(FullyShardedDataParallel.of_sharded(module) wraps a sharded root again)")
        sharding_strategy = read_sharding_strategy(sharding_strategy)
        mixed_precision = read_mixed_precision(mixed_precision)
        _check_compression(compression, mixed_precision)
        cpu_offload = read_cpu_offload(cpu_offload)
        auto_wrap_policy = None if auto_wrap_policy is None else as_wrap_policy(auto_wrap_policy)
        offloaded = cpu_offload is not None and cpu_offload.offload_params
        if device_id is not None and device is not None:
            raise ValueError("give device= or device_id= (torch FSDP's name for it), not both")
        device = device if device_id is None else device_id
        device = torch.device(device) if isinstance(device, (str, int)) else device
        check_module_can_be_sharded(module, device)
        comm = comm if isinstance(comm, Communicator) else Communicator(comm)
        overlap = Overlap(forward_prefetch=forward_prefetch, backward_prefetch=backward_prefetch,
                          async_reduce_scatter=async_reduce_scatter)
        deferred = is_deferred(module)
        if deferred:
            device = device or torch.device("cpu")
            _move_buffers(module, device)
        elif device is not None and offloaded:  # the parameters go into host shards, never whole to the device
            _move_buffers(module, device)
        elif device is not None:
            module.to(device)

        nested_in_wrap = _groups is not None  # the outermost call passes the tree's groups to the nested ones
        if not nested_in_wrap:
            _groups = ShardGroups(comm, sharding_strategy, hybrid_group_size)
            _set_up_the_tree(module, comm, _groups, device, sync_module_states, mixed_precision)
        if auto_wrap_policy is not None:
            def wrap_nested(child: nn.Module) -> FullyShardedDataParallel:
                return FullyShardedDataParallel(child, comm=comm, sharding_strategy=sharding_strategy,
                                                mixed_precision=mixed_precision, compression=compression,
                                                device=device, cpu_offload=cpu_offload, **vars(overlap),
                                                _groups=_groups)

            apply_wrap_policy(module, auto_wrap_policy, wrap_nested, FullyShardedDataParallel)
        self._hold(module, ShardedUnit(module, comm, _groups, sharding_strategy, overlap, mixed_precision, device,
                                       compression, cpu_offload))
        if deferred and not nested_in_wrap:
            materialize_into_shards(module, self._unit.context.units, param_init_fn, comm, sync_module_states)
        if not nested_in_wrap:
            _reserve_node_memory(self._unit.context.units, _groups)
            give_back_freed_host_memory()  # the model's full parameters, which the shards replaced

    @staticmethod
    def is_sharded(module: nn.Module) -> bool:
        """Whether an earlier ``FullyShardedDataParallel`` sharded `module` as its root (see ``of_sharded``)."""
        unit = module.__dict__.get(UNIT_ATTRIBUTE)
        return unit is not None and unit.is_root

    @classmethod
    def of_sharded(cls, module: nn.Module, *, comm: Communicator | None = None,
                   sharding_strategy: ShardingStrategy | None = None,
                   mixed_precision: MixedPrecision | None = None) -> "FullyShardedDataParallel":
        """A wrapper for `module`, which an earlier ``FullyShardedDataParallel`` sharded as its root (that wrapper
        may be gone): the same unit, shards and groups, nothing gathered or copied. What a framework that sets
        the same model up more than once calls: a Lightning Trainer's ``test()`` after its ``fit()``.

        A model is not sharded again in place: the settings given must be those it was sharded with (ValueError
        naming what differs); `comm` must hold the same ranks.
        """
        if not cls.is_sharded(module):
            raise ValueError(f"{type(module).__name__} is not the root of a sharded model: wrap it with "
                             "FullyShardedDataParallel(module, ...)")
        unit = module.__dict__[UNIT_ATTRIBUTE]
        differences = []
        if comm is not None and not comm.holds_the_ranks_of(unit.comm):
            differences.append(f"ranks: {unit.comm.world_size}, not these {comm.world_size}")
        if sharding_strategy is not None and read_sharding_strategy(sharding_strategy) != unit.sharding_strategy:
            differences.append(f"sharding_strategy: {unit.sharding_strategy.name}, not "
                               f"{read_sharding_strategy(sharding_strategy).name}")
        if mixed_precision is not None and read_mixed_precision(mixed_precision) != unit.mixed_precision:
            differences.append(f"mixed_precision: {unit.mixed_precision}, not {read_mixed_precision(mixed_precision)}")
        if differences:
            raise ValueError(f"{type(module).__name__} was sharded with other settings ({'; '.join(differences)}); "
                             "a sharded model keeps its own: build the model anew to shard it otherwise")
        wrapper = cls.__new__(cls)
        nn.Module.__init__(wrapper)
        wrapper._hold(module, unit)
        return wrapper

    def _hold(self, module: nn.Module, unit: ShardedUnit) -> None:
        self.add_module(WRAPPED_MODULE, module)
        self._unit = unit
        self.register_forward_pre_hook(self._gather_traced, prepend=True, with_kwargs=True)
        self.register_forward_hook(self._release_traced)

    @property
    def forward(self):
        """What ``nn.Module.__call__`` calls. In code that torch.compile traces, the wrapped module's own call,
        so that no frame of the wrapper's lies between the model's frames (the wrapper's hooks gather around it,
        ``traced.gather_in_graph``). Otherwise a method of the wrapper's that calls the module: what
        ``torch.compile(model)`` finds when it wraps the model (a forward from torch's own files would make it
        add a frame of its own above the model's)."""
        if torch.compiler.is_compiling():
            return self.module.__call__
        mark_eager_frames_for_dynamo()
        return self._call_wrapped

    def _call_wrapped(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @eager_as_a_frame_of_its_own
    def _gather_traced(self, _wrapper, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        return gather_in_graph(self._unit, args, kwargs)

    @eager_as_a_frame_of_its_own
    def _release_traced(self, _wrapper, _args: tuple, _output) -> None:
        release_in_graph(self._unit)

    # ----------------------------------------------------------------- transparency

    @property
    def module(self) -> nn.Module:
        """The wrapped module."""
        return self._modules[WRAPPED_MODULE]

    def __getattr__(self, name: str):
        """Attributes the wrapper lacks are the wrapped module's (``model.config``, ``model.generate``)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED_MODULE or WRAPPED_MODULE not in self._modules:
                raise
            return getattr(self._modules[WRAPPED_MODULE], name)

    def __getitem__(self, index):
        """Indexes a wrapped container (``nn.Sequential``, ``nn.ModuleList``)."""
        return self.module[index]

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """The original names, each with this rank's part of that parameter (a 1-D sharded view)."""
        for name, param in super().named_parameters(prefix, recurse, remove_duplicate):
            yield original_name(name), param

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        for name, buffer in super().named_buffers(prefix, recurse, remove_duplicate):
            yield original_name(name), buffer

    # ----------------------------------------------------------------- the unit

    @property
    def is_root(self) -> bool:
        return self._unit.is_root

    @property
    def handles(self):
        """This unit's flat parameter handles (one per dtype and requires_grad group)."""
        return self._unit.handles

    @property
    def comm(self) -> Communicator:
        return self._unit.comm

    @property
    def groups(self) -> ShardGroups:
        """This rank's shard group and replica group (``strategy.ShardGroups``): which ranks split a shard,
        which hold copies of it."""
        return self._unit.groups

    def set_requires_gradient_sync(self, requires_gradient_sync: bool) -> None:
        """Whether backward reduce-scatters gradients (default) or keeps them unsharded to reduce later.

        With False, each unit's full-size gradient (``padded_numel`` elements) stays
        on every rank and later backward calls add to it; the first backward with
        True adds its gradient and reduces the sum once. Applies to every unit in this module.
        """
        for _, unit in units_with_names(self):
            unit.requires_gradient_sync = requires_gradient_sync

    @contextmanager
    def no_sync(self):
        """Gradient accumulation without communication: see ``set_requires_gradient_sync(False)``."""
        self.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            self.set_requires_gradient_sync(True)

    # ----------------------------------------------------------------- state dicts

    def state_dict(self, *args, destination=None, prefix: str = "", keep_vars: bool = False):
        """The full, unsharded state dict with the original parameter names, on rank 0 only.

        Other ranks get an empty dict. Every rank must call it (it gathers). Arguments as torch's
        ``Module.state_dict``, positional ones (destination, prefix) included; ``keep_vars=True`` is refused:
        the values are gathered copies, never the parameters themselves.
        """
        if len(args) > 2:
            raise TypeError(f"state_dict() takes at most 2 positional arguments (destination, prefix), got {len(args)}")
        positional = dict(zip(("destination", "prefix"), args))
        destination, prefix = positional.get("destination", destination), positional.get("prefix", prefix)
        if keep_vars:
            raise ValueError("state_dict(keep_vars=True): a sharded model's full state dict holds gathered copies, "
                             "not its parameters; use summon_full_params(model) to reach those")
        state = full_state_dict(self, rank0_only=True)
        destination = {} if destination is None else destination
        destination.update({prefix + name: tensor for name, tensor in state.items()})
        return destination

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """Loads a full state dict (original names) given on every rank; each rank copies its part into its shard.

        ``assign=True`` (make the given tensors the parameters) is refused: the parameters are views of the
        rank's flat shard, which must stay one buffer.
        """
        if assign:
            raise ValueError("load_state_dict(assign=True): a sharded model's parameters are views of its flat "
                             "shards and cannot be replaced by the given tensors; load with assign=False (copies)")
        return load_full_state_dict(self, state_dict, strict=strict)


FSDP = FullyShardedDataParallel


def _set_up_the_tree(module: nn.Module, comm: Communicator, groups: ShardGroups, device: torch.device | None,
                     sync_module_states: bool, mixed_precision: MixedPrecision) -> None:
    """What the outermost call does once for the whole model, before any unit is built: a rank's uncaught
    exception ends the job, freed host memory is kept for reuse on a CPU, the route is chosen and reported,
    every rank is shown to hold the same model, rank 0's states go to every rank, and buffers take their
    dtype."""
    # A rank's uncaught exception ends the job: the wrapper's ranks, or, where the wrapper's communicator is this
    # rank alone in a job of several (each rank holding the whole model), the job's, whose other ranks would
    # otherwise wait for it forever. A job of one rank ends by itself.
    if comm.world_size > 1:
        abort_job_on_uncaught_exception(comm.mpi_comm)
    elif job_comm().Get_size() > 1:
        abort_job_on_uncaught_exception()
    computes_on = device or next(module.parameters()).device
    if computes_on.type == "cpu":
        problem = keep_freed_host_memory_for_reuse()
        if problem and comm.rank == 0:
            print(f"fsdp_mpi: {problem}", file=sys.stderr, flush=True)
    # one rank per shard group: the tensors that travel go between replicas, on their route
    shared = groups.shard if groups.shard.world_size > 1 or groups.replicas is None else groups.replicas
    report_route_once(shared.describe_route(computes_on), comm.rank)  # collective: chooses the route
    check_same_model_on_all_ranks(module, comm)
    if sync_module_states:
        _broadcast_module_states(module, comm)
    if mixed_precision.buffer_dtype is not None:
        _cast_floating_buffers(module, mixed_precision.buffer_dtype)


def _reserve_node_memory(units, groups: ShardGroups) -> None:
    """Grows the node transport's memory at set-up to what the largest unit's collectives need (collective), so
    that it does not grow in the first backward, near the step's peak: a reduce-scatter takes the unit's whole
    padded buffer, an all-reduce over the replicas its shard."""
    handles = [handle for unit in units for handle in unit.handles]
    if not handles:
        return
    largest = max(handles, key=lambda h: h.padded_numel * max(h.param_dtype.itemsize, h.gradient.reduce_dtype.itemsize))
    itemsize = max(largest.param_dtype.itemsize, largest.gradient.reduce_dtype.itemsize)
    groups.shard.reserve(largest.compute_device, largest.padded_numel * itemsize)
    if groups.replicas is not None:
        groups.replicas.reserve(largest.compute_device, largest.shard_numel * itemsize)


def _check_compression(compression: Compression | None, mixed_precision: MixedPrecision) -> None:
    if compression is not None and not isinstance(compression, Compression):
        raise TypeError(f"compression must be a fsdp_mpi.Compression, got {compression!r}")
    if compression is not None and compression.gradients and mixed_precision.reduce_dtype is not None:
        raise ValueError(f"Compression(gradients={compression.gradients!r}) and MixedPrecision(reduce_dtype="
                         f"{mixed_precision.reduce_dtype}) both say how gradients are reduced: set only one "
                         "(a compressed reduction always sums in fp32)")


def _broadcast_module_states(module: nn.Module, comm: Communicator) -> None:
    """Copies rank 0's parameters and buffers (outside existing units; not those still on meta) to every rank."""
    with torch.no_grad():
        for _, submodule in modules_outside_units(module):
            for tensor in [*submodule._parameters.values(), *submodule._buffers.values()]:
                if tensor is not None and not tensor.is_meta:
                    comm.broadcast_(tensor.data)


def _move_buffers(module: nn.Module, device: torch.device) -> None:
    """Moves buffers only: the parameters of a model on meta are materialised into shards on `device`."""
    for submodule in module.modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None:
                submodule._buffers[name] = buffer.to(device)


def _cast_floating_buffers(module: nn.Module, dtype: torch.dtype) -> None:
    """Replaces each floating-point buffer in `module` by a copy in `dtype` (``buffer_dtype``), once."""
    for submodule in module.modules():
        for name, buffer in submodule._buffers.items():
            if buffer is not None and buffer.is_floating_point():
                submodule._buffers[name] = buffer.to(dtype)

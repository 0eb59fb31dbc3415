"""Bad input fails at wrap time with a clear message and leaves the module untouched; so does a bad launch."""

import subprocess
import sys

import pytest
import torch
from mpi_launch import REPO_ROOT, child_env
from torch import nn

from fsdp_mpi import FullyShardedDataParallel, ModuleWrapPolicy, ShardingStrategy
from fsdp_mpi.communication.failures.launcher import LauncherMismatchError, check_launcher_agrees


def test_module_without_parameters():
    with pytest.raises(ValueError, match="has no parameters: there is nothing to shard"):
        FullyShardedDataParallel(nn.ReLU())


def test_integer_parameters():
    module = nn.Linear(2, 2)
    module.counts = nn.Parameter(torch.zeros(3, dtype=torch.int64), requires_grad=False)
    with pytest.raises(TypeError, match=r"only floating-point parameters can be sharded; found counts \(torch.int64\)"):
        FullyShardedDataParallel(module)
    assert "weight" in module._parameters  # nothing was flattened


def test_parameters_on_mixed_devices():
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match=r"parameters are on several devices \(cpu, meta\)"):
        FullyShardedDataParallel(module)


@pytest.mark.one_rank
def test_wrapping_twice():
    wrapped = FullyShardedDataParallel(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="already wrapped"):
        FullyShardedDataParallel(wrapped)


def test_not_a_module_and_bad_strategy():
    with pytest.raises(TypeError, match="wraps an nn.Module"):
        FullyShardedDataParallel(torch.zeros(3))
    with pytest.raises(TypeError, match="sharding_strategy must be fsdp_mpi.ShardingStrategy"):
        FullyShardedDataParallel(nn.Linear(2, 2), sharding_strategy="full")
    assert ShardingStrategy.FULL_SHARD.value == "full_shard"


@pytest.mark.parametrize("variable", ["SLURM_STEP_NUM_TASKS", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "PMIX_SIZE"])
def test_a_launcher_that_started_more_tasks_than_mpi_sees_is_named(monkeypatch, variable):
    monkeypatch.setenv(variable, "4")
    with pytest.raises(LauncherMismatchError, match=f"the launcher started 4 tasks \\({variable}=4\\), but MPI sees a "
                                                    "world of 1 rank"):
        check_launcher_agrees(world_size=1)
    check_launcher_agrees(world_size=4)  # the same variable with a matching world: fine
    monkeypatch.setenv(variable, "1")
    check_launcher_agrees(world_size=1)


def test_an_experiment_started_as_n_one_rank_worlds_stops_before_writing(tmp_path):
    env = child_env(SLURM_STEP_NUM_TASKS="2")  # plain srun -n 2
    # A run of one step: where the mismatch went unnoticed, it would end soon, having written a CSV.
    result = subprocess.run([sys.executable, str(REPO_ROOT / "experiments" / "run_gpt2.py"), "--out-dir",
                             str(tmp_path / "results"), "--device", "cpu", "--epochs", "1", "--steps-per-epoch", "1",
                             "--val-steps", "1", "--no-progress"], env=env, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2
    assert "run_gpt2.py: error: the launcher started 2 tasks (SLURM_STEP_NUM_TASKS=2)" in result.stderr
    assert "srun --mpi=pmi2" in result.stderr and "mpiexec -n 2" in result.stderr
    assert not (tmp_path / "results").exists()


class Block(nn.Sequential):
    """A unit of its own under the wrap policy below."""


class Metric(nn.Module):
    """A module whose ``_apply`` takes other arguments, as torchmetrics' ``Metric._apply(fn, exclude_state)``."""

    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(1))
        self.excluded = None

    def _apply(self, fn, exclude_state=()):
        self.excluded = exclude_state
        return super()._apply(fn)

    def forward(self, x):
        return x


CHANGES = {"half()": lambda m: m.half(), "double()": lambda m: m.double(), "to(float64)": lambda m: m.to(torch.float64),
           "to_empty()": lambda m: m.to_empty(device="cpu")}


@pytest.mark.one_rank
def test_moving_or_casting_a_wrapped_model_or_any_module_inside_is_refused_unless_it_changes_nothing():
    """``.to()`` and its kin would part the sharded views from the shards that gathers read, whether called on
    the wrapper, the module it wraps, a nested unit or a module inside one; where they change nothing (the device
    and dtype it is on, or a module without parameters), they pass, and the model still trains."""
    torch.manual_seed(0)
    wrapped = FullyShardedDataParallel(
        nn.Sequential(nn.Linear(3, 4), Block(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 1), Metric()),
        auto_wrap_policy=ModuleWrapPolicy({Block}))
    root_part, nested, nested_part = wrapped.module[0], wrapped.module[1], wrapped.module[1].module[0]
    not_refused = []
    for where in (wrapped, wrapped.module, root_part, nested, nested.module, nested_part):
        for change, call in CHANGES.items():
            try:
                call(where)
            except RuntimeError as error:
                assert "sharded in place: moving or casting it after wrapping" in str(error)
            else:
                not_refused.append((type(where).__name__, change))
        assert where.to("cpu") is where and where.float() is where and where.cpu() is where
    assert not_refused == []
    relu = nested.module[1]
    assert relu.half() is relu  # nothing of a unit's below it
    # A module inside a unit whose _apply takes other arguments is called as it expects, from the wrapper down.
    metric = wrapped.module[3]
    assert wrapped.to("cpu") is wrapped and metric.excluded == ()
    assert all(p.dtype == torch.float32 for p in wrapped.parameters())
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    losses = []
    for _ in range(2):
        loss = nn.functional.mse_loss(wrapped(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[1] < losses[0]  # the steps reached the weights that forward gathers


@pytest.mark.one_rank
def test_torch_fsdp_wrap_policies_wrap_as_ours_and_anything_else_is_refused():
    """A policy written for torch's FSDP selects the units it selects there: asked first whether to look inside
    a module (recurse=True), torch's size-based policy looks inside neither a small subtree nor attention, whose
    parameters then stay in their parent's unit."""
    import functools

    from torch.distributed.fsdp import wrap as torch_wrap

    from fsdp_mpi import SizeBasedWrapPolicy

    def units(policy) -> list[str]:
        model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 300),
                              nn.MultiheadAttention(32, 1))  # its out_proj: a Linear of 1056 parameters
        FullyShardedDataParallel(model, auto_wrap_policy=policy)
        return [name for name, module in model.named_modules() if isinstance(module, FullyShardedDataParallel)]

    by_class = units(ModuleWrapPolicy({nn.Linear}))
    assert by_class == ["0", "1.0", "2", "3.out_proj"]
    assert units(torch_wrap.ModuleWrapPolicy({nn.Linear})) == by_class
    assert units(functools.partial(torch_wrap.transformer_auto_wrap_policy,
                                   transformer_layer_cls={nn.Linear})) == by_class
    assert units(functools.partial(torch_wrap.size_based_auto_wrap_policy, min_num_params=1000)) == ["2"]
    assert units(SizeBasedWrapPolicy(1000)) == ["2", "3", "3._fsdp_wrapped_module.out_proj"]  # ours looks inside
    for bad, named in ((torch_wrap.CustomPolicy(lambda module: True), "CustomPolicy"), ("Linear", "'Linear'"),
                       (lambda module: True, "lambda")):
        model = nn.Linear(2, 2)
        with pytest.raises(TypeError, match=f"auto_wrap_policy must be .* got .*{named}"):
            FullyShardedDataParallel(model, auto_wrap_policy=bad)
        assert "weight" in model._parameters  # nothing was flattened


@pytest.mark.one_rank
def test_torch_fsdp_options_are_read_as_ours_and_what_cannot_be_is_refused():
    """Code written for torch's FSDP passes its ShardingStrategy, MixedPrecision, CPUOffload and device_id as they
    are; a setting fsdp_mpi cannot honour (low-precision .grad) is a TypeError that says why."""
    import torch.distributed.fsdp as torch_fsdp

    from fsdp_mpi import CPUOffload, MixedPrecision
    from fsdp_mpi.sharding.torch_options import read_cpu_offload

    model = nn.Linear(4, 4)
    wrapped = FullyShardedDataParallel(model, sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
                                       mixed_precision=torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16),
                                       cpu_offload=torch_fsdp.CPUOffload(offload_params=True), device_id="cpu")
    unit = wrapped._unit
    assert unit.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP
    assert unit.mixed_precision == MixedPrecision(param_dtype=torch.bfloat16)
    assert unit.handles[0].gradient.reduce_dtype == torch.float32  # reduce_dtype unset: summed in fp32, as ours
    assert wrapped(torch.ones(2, 4)).dtype == torch.bfloat16
    # on a CPU an offloaded shard is where it was: what the wrapper was given is read as
    assert read_cpu_offload(torch_fsdp.CPUOffload(offload_params=True)) == CPUOffload(offload_params=True)
    for options, error, message in (
            ({"mixed_precision": torch_fsdp.MixedPrecision(torch.bfloat16, keep_low_precision_grads=True)},
             TypeError, r"keep_low_precision_grads=True\) is not supported"),
            ({"sharding_strategy": torch_fsdp.ShardingStrategy._HYBRID_SHARD_ZERO2}, TypeError,
             r"sharding_strategy must be fsdp_mpi.ShardingStrategy \(FULL_SHARD, SHARD_GRAD_OP, HYBRID_SHARD, "
             r"NO_SHARD\), torch FSDP's of the same name, or the name, got <ShardingStrategy._HYBRID_SHARD_ZERO2"),
            ({"cpu_offload": True}, TypeError, "cpu_offload must be a fsdp_mpi.CPUOffload or torch FSDP's"),
            ({"device": "cpu", "device_id": "cpu"}, ValueError, "give device= or device_id=")):
        model = nn.Linear(2, 2)
        with pytest.raises(error, match=message):
            FullyShardedDataParallel(model, **options)
        assert "weight" in model._parameters  # nothing was flattened

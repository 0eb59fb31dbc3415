"""Bad input fails at wrap time with a clear message and leaves the module untouched."""

import pytest
import torch
from torch import nn

from fsdp_mpi import FullyShardedDataParallel, ShardingStrategy


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
    with pytest.raises(TypeError, match="sharding_strategy must be a ShardingStrategy"):
        FullyShardedDataParallel(nn.Linear(2, 2), sharding_strategy="full")
    assert ShardingStrategy.FULL_SHARD.value == "full_shard"

"""How much of a unit's state each rank keeps between uses."""

from enum import Enum


class ShardingStrategy(Enum):
    """Names follow torch FSDP so that users feel at home.

    FULL_SHARD: parameters, gradients and optimizer state are sharded; a unit's
        full parameters exist only while it computes (ZeRO-3).
    SHARD_GRAD_OP: like FULL_SHARD, but a unit keeps its gathered parameters from
        its forward until its backward, trading memory for one all-gather less (ZeRO-2-like).
    """

    FULL_SHARD = "full_shard"
    SHARD_GRAD_OP = "shard_grad_op"

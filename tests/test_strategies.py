"""HYBRID_SHARD and NO_SHARD on 4 ranks acting as 2 nodes of 2 (see workers/strategies.py)."""

import json

from mpi_launch import check_ok, run_mpi


def test_hybrid_and_no_shard_train_as_one_process_keep_the_expected_bytes_and_checkpoint(tmp_path):
    out = tmp_path / "strategies.json"
    check_ok(run_mpi("strategies.py", 4, out, tmp_path / "checkpoint", timeout=600))
    result = json.loads(out.read_text())
    assert set(result["equivalence"]) == {f"{strategy}/{run}" for strategy in ("hybrid", "no_shard") for run in (
        "gpt2/adamw/none", "mlp/sgd/no_sync", "gpt2/adamw/sharded/bf16", "gpt2/adamw/none/overlapped")}

    # Bytes of parameter shards and reduced gradient shards on every rank: the padded flat buffers over the
    # shard group's size (4 ranks: FULL_SHARD 1/4, HYBRID_SHARD in groups of 2 1/2, NO_SHARD everything),
    # and the bytes of a step's gradient collectives, counted by the model's communicator.
    for strategy, group, replicas in (("full_shard", 4, 1), ("hybrid", 2, 2), ("no_shard", 1, 4)):
        for rank in result["memory"][strategy]:
            assert (rank["shard_group_size"], rank["replicas"]) == (group, replicas), strategy
            assert rank["shard_bytes"] == rank["grad_bytes"] == rank["padded_bytes"] // group, strategy
            assert rank["gathered_after_step"] == 0, strategy
            # a step's gradients: reduce-scattered in the shard group, the shard then all-reduced over replicas;
            # then one 4-byte flag per parameter tensor over every rank (which got a gradient somewhere)
            moved = rank["moved"]
            assert moved.get("reduce_scatter", 0) == (rank["padded_bytes"] if group > 1 else 0), strategy
            flags = 4 * rank["parameter_tensors"]
            assert moved.get("all_reduce", 0) == (rank["padded_bytes"] // group if replicas > 1 else 0) + flags, strategy
    assert result["checkpoint_loads"] == [True] * 4  # saved under HYBRID_SHARD, loaded under FULL_SHARD
    # int8 weights and gradients in groups of 2: the compressed replica all-reduce keeps replicas identical
    assert result["compressed_hybrid"] == [{"bytes_as_closed_form": True, "loss_falls": True,
                                            "replicas_identical": True}] * 4

    groups = result["groups"]
    assert groups["by_node"] == 4 and groups["from_environment"] == 2  # one machine is one node
    assert "groups of 3 ranks do not divide the 4 ranks" in groups["refused"]["not_dividing"]
    assert "applies to ShardingStrategy.HYBRID_SHARD only" in groups["refused"]["not_hybrid"]

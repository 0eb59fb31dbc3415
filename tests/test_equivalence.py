"""Training on N ranks must match one process on the same global batch (see workers/equivalence.py, which
checks each run as it ends: here, which runs there were)."""

import json

import pytest
from mpi_launch import check_ok, run_mpi

MODELS = ("mlp", "gpt2", "bert", "torch_encoder", "hf_gpt2", "hf_bert")


# 3 ranks (uneven shards, padding) under both MPIs; 2 under the first only
@pytest.mark.parametrize("nprocs", [pytest.param(2, marks=pytest.mark.one_mpi), 3])
def test_every_model_trains_as_on_one_process(nprocs, tmp_path):
    out = tmp_path / "equivalence.json"
    check_ok(run_mpi("equivalence.py", nprocs, out, timeout=600))
    results = json.loads(out.read_text())
    expected = {f"{m}/{o}/none" for m in MODELS for o in ("sgd", "adamw")}
    expected |= {"gpt2/adamw/sharded", "gpt2/adamw/no_sync", "hf_gpt2/sgd/no_sync"}
    expected |= {"gpt2_dropout/adamw/sharded", "bert_dropout/adamw/none"}  # dropout 0.2, drawn per sample
    expected |= {"mlp/sgd/none/bf16", "gpt2/adamw/sharded/bf16", "bert/sgd/none/bf16", "torch_encoder/adamw/none/bf16",
                 "hf_gpt2/adamw/none/bf16"}
    expected |= {"gpt2/adamw/no_sync/offload", "bert/adamw/sharded/bf16/offload"}  # CPUOffload, copies home late
    assert set(results) == expected


@pytest.mark.one_mpi  # the sharding layer's logic; under a second MPI, the collectives worker checks every path it takes
def test_four_ranks_as_two_nodes_with_empty_parts(tmp_path):
    """On 4 ranks some parameters have no elements on some ranks (0-element sharded views); the 4 ranks act as 2
    nodes of 2 (FSDP_MPI_EMULATED_NODE_SIZE), so every collective goes in two levels: FULL_SHARD, SHARD_GRAD_OP,
    bf16, accumulation (compressed: test_compression.py's 2 x 2 runs)."""
    out = tmp_path / "equivalence.json"
    check_ok(run_mpi("equivalence.py", 4, out, "nodes", env={"FSDP_MPI_EMULATED_NODE_SIZE": "2"}))
    results = json.loads(out.read_text())
    assert "gpt2/adamw/none/SHARD_GRAD_OP" in results and "gpt2/adamw/sharded/bf16" in results


@pytest.mark.one_mpi  # the sharding layer's handling of these models; their collectives are the matrix's
def test_a_layer_run_several_times_and_frozen_parts_train_as_on_one_process(tmp_path):
    """ALBERT's one layer group computes 4 times per forward; BERT with frozen whole units (the gradient flows
    through them) and frozen parameters inside units and the root (see workers/equivalence.py)."""
    out = tmp_path / "families.json"
    check_ok(run_mpi("equivalence.py", 2, out, "families"))
    results = json.loads(out.read_text())
    assert set(results) == {"hf_albert/adamw/none", "hf_albert/sgd/no_sync", "hf_bert_frozen/adamw/none",
                            "hf_bert_frozen/sgd/none/bf16"}


WHOLE_RUNS = {"gpt2/sgd/no_sync/whole", "bert/sgd/none/whole", "gpt2/adamw/sharded/bf16/whole/overlap"}


@pytest.mark.one_mpi  # compiled code around the same collectives as eager
@pytest.mark.torch_range  # dynamo and inductor: CI runs it on the newest torch too
@pytest.mark.parametrize("nprocs, runs", [(2, "compiled"), (3, "compiled_whole")])
def test_a_compiled_model_trains_as_one_eager_process_in_the_graphs_of_the_unwrapped_model(nprocs, runs, tmp_path):
    """torch.compile on the whole wrapped model (the gathers and reductions traced as custom ops), with no_sync,
    with bf16 and every overlap switch, on 3 ranks (uneven shards); on 2 on each unit's module, on HF's GPT-2,
    with inductor, and where each rank holds the whole model. The same step checks as eager sharding against one
    eager process (compiled kernels round differently, within the bounds' rounding), and dynamo breaks the
    wrapped model's graph exactly where it breaks the same model unwrapped: fsdp_mpi adds no break (see
    workers/equivalence.py)."""
    out = tmp_path / "compiled.json"
    check_ok(run_mpi("equivalence.py", nprocs, out, runs, timeout=600))
    results = json.loads(out.read_text())
    expected = {"gpt2/adamw/none/units", "hf_gpt2/sgd/none/whole", "gpt2/adamw/none/whole_inductor",
                "gpt2/adamw/none/one_rank_whole"} if runs == "compiled" else WHOLE_RUNS
    assert set(results) == expected
    assert all("graphs" in results[run] for run in expected if "whole" in run)  # the worker compared them


@pytest.mark.one_mpi  # dynamo around the hooks of the same collectives as eager
@pytest.mark.torch_range  # dynamo rewrites bytecode: CI runs it on the newest torch and on the oldest Python too
def test_a_compiled_model_breaks_its_graph_inside_a_unit_only_where_the_unwrapped_model_does(tmp_path):
    """Where the model's own code breaks dynamo's graph inside a unit (a print in a block, with dynamo's defaults,
    with nested graph breaks, and inside a compiled function that calls the model; HF's GPT-2, whose root warns),
    the wrapped model breaks exactly where the unwrapped one does, on 2 ranks: fsdp_mpi adds no break (see
    workers/equivalence.py). A test of its own, so that a mutant of the compiled training runs does not wait
    for these compilations."""
    out = tmp_path / "breaks.json"
    check_ok(run_mpi("equivalence.py", 2, out, "breaks", timeout=600))
    results = json.loads(out.read_text())
    assert set(results) == {"breaks_inside_a_unit"}
    assert set(results["breaks_inside_a_unit"]) == {"printing", "printing/nested", "printing/function", "hf_gpt2"}


@pytest.mark.one_mpi  # the sharding layer's logic; under a second MPI, the collectives worker checks every path it takes
def test_parameters_that_no_rank_used_get_no_gradient(tmp_path):
    """A skipped branch (a unit, and a layer in the root), an expert no token chose, a head used on one rank
    only, a computed but unused layer: .grad None exactly where one process has it, so AdamW leaves those
    parameters bit for bit alone; the rest match one process. Compiled whole, the same where the use is the
    same on every rank (see workers/unused_parameters.py)."""
    out = tmp_path / "unused.json"
    check_ok(run_mpi("unused_parameters.py", 3, out))
    report = json.loads(out.read_text())
    always = ["experts.linears.3.bias", "experts.linears.3.weight", "router.bias", "router.weight"]
    skipped = ["branch.0.bias", "branch.0.weight", *always[:2], "rare_head.bias", "rare_head.weight", *always[2:],
               "side.bias", "side.weight"]
    assert report["sync"]["no_gradient_names"] == report["bf16"]["no_gradient_names"] == [always, skipped] * 2
    assert report["no_sync"]["no_gradient_names"][2] == sorted(["branch.0.bias", "branch.0.weight", "side.bias",
                                                                "side.weight", *always])
    never = [*(f"experts.linears.{i}.{p}" for i in range(4) for p in ("bias", "weight")), "rare_head.bias",
             "rare_head.weight", "router.bias", "router.weight"]
    odd_steps = sorted([*never, "branch.0.bias", "branch.0.weight", "side.bias", "side.weight"])
    assert report["compiled"]["no_gradient_names"] == [never, odd_steps] * 2
    # A break inside the root's graph (a part gathered eagerly): the same, the root's parameters being inputs
    # of the graph (the root gathers outside it).
    part = report["compiled_part"]
    assert part["no_gradient_names"] == [never[2:], [n for n in odd_steps if not n.startswith("experts.linears.0")]] * 2
    assert report["compiled_no_sync"]["no_gradient_names"][2] == sorted([*never, "branch.0.bias", "branch.0.weight",
                                                                         "side.bias", "side.weight"])
    assert report["compiled_accumulation"]["same_none_pattern"]  # and the rest of each mode's checks: the worker's


@pytest.mark.one_mpi  # the lifecycle's logic; its collectives are the ones every other test takes
def test_the_optimizer_stepped_inside_backward_makes_the_same_step_as_after_it(tmp_path):
    """step_in_backward on 3 ranks, a handle at a time as gradients become final: parameters and optimizer state
    bit for bit those of optimizer.step() after backward, whatever rank used which parameter, inline or on a
    thread, offloaded, accumulated, asynchronous, NO_SHARD, bf16, a frozen layer, compiled whole, for-loop / foreach / fused AdamW and SGD; inline, the
    units behind the first layer step before backward reaches it; each misuse refused (workers/step_in_backward.py)."""
    out = tmp_path / "step_in_backward.json"
    check_ok(run_mpi("step_in_backward.py", 3, out))
    report = json.loads(out.read_text())
    assert set(report) == {"refusals", "inline", "thread_offloaded", "no_sync_fused", "async_sgd", "no_shard",
                           "bf16_offloaded", "frozen_part", "compiled_no_sync"}  # each checked by the worker


@pytest.mark.one_mpi  # the sharding layer's logic; under a second MPI, the collectives worker checks every path it takes
def test_any_entry_point_gathers_what_it_needs_and_matches_one_process(tmp_path):
    """A part of the root unit, a part of a nested unit, and an encoder-decoder's training step and generate(),
    on 3 ranks against one process (see workers/entry_points.py)."""
    out = tmp_path / "entry_points.json"
    check_ok(run_mpi("entry_points.py", 3, out))
    report = json.loads(out.read_text())
    for key, value in report.items():
        if key.endswith("_error"):
            assert value <= (1e-6 if key.startswith("t5") else 1e-9), key
        elif key != "t5_generate/length":
            assert value is True, key
    assert report["t5_generate/length"] == 7  # the start token and 6 generated
    assert {key.split("/")[0] for key in report} == {"root_part_no_grad", "root_part_autograd", "nested_part_autograd",
                                                     "t5_train", "t5_generate"}


@pytest.mark.one_mpi  # the sharding layer's logic; under a second MPI, the collectives worker checks every path it takes
def test_staging_chunking_strategy_checkpointing_and_overlap_change_nothing(tmp_path):
    out = tmp_path / "variants.json"
    check_ok(run_mpi("variants.py", 3, out))
    differing_tensors = json.loads(out.read_text())
    assert set(differing_tensors) == {"through_mpi", "staged", "chunked", "small_exchanges", "shard_grad_op",
                                      "checkpointed", "overlapped", "staged_overlapped"}
    assert differing_tensors == {variant: [] for variant in differing_tensors}


TRUE_WEIGHTS = [1.5, -2.0, 0.5, 3.0, -1.0]


@pytest.mark.one_mpi  # the sharding layer's logic; under a second MPI, the collectives worker checks every path it takes
def test_linear_regression_reaches_the_least_squares_answer_for_any_rank_count(tmp_path):
    """Gradient descent (lr 0.1, Hessian eigenvalues about 1.5 to 2.6) contracts by 0.85 a step at worst:
    after 300 steps only float32 rounding is left, about 1e-6; the noise moves the answer about 0.03 from
    the true weights, and a rank's own samples' answer as far from the global one."""
    fitted = {}
    for nprocs in (1, 2, 3):
        out = tmp_path / f"fit{nprocs}.json"
        check_ok(run_mpi("known_answer.py", nprocs, out, *TRUE_WEIGHTS))
        result = json.loads(out.read_text())
        fitted[nprocs] = result["weights"]
        assert fitted[nprocs] == pytest.approx(result["least_squares"], abs=1e-4)
        assert max(abs(a - b) for a, b in zip(result["least_squares"], TRUE_WEIGHTS)) > 1e-2  # the noise matters
    assert fitted[2] == pytest.approx(fitted[1], abs=1e-5)
    assert fitted[3] == pytest.approx(fitted[1], abs=1e-5)


@pytest.mark.one_mpi  # the sharding layer's logic; under a second MPI, the collectives worker checks every path it takes
def test_wrapped_models_generate_and_show_original_names(tmp_path):
    out = tmp_path / "generate.json"
    check_ok(run_mpi("generate.py", 3, out))
    report = json.loads(out.read_text())
    assert report == {
        "matches_plain": True, "same_on_all_ranks": True, "length": 15,
        "same_names": True, "parts_add_up": True, "all_one_dimensional": True,
        "hf_matches_plain": True, "hf_length": 14, "hf_resharded_after": True, "hf_wte_at_rest_is_view": True,
        "hf_lm_head_tied_to_wte": True, "hf_same_names": True, "hf_parts_add_up": True,
        "hf_all_one_dimensional": True,
    }

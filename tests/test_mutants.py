"""Proof that the suite catches breakage: each mutant is a deliberate one-line break of the code,
applied to a copy of the repository. The tests it names must pass on the code as it is, and one of their
checks must fail on the mutant: a failed assertion (see harness/mutation_verdict.py), not an error, crash or timeout.

A mutant that survives means a mechanism nobody checks. Every new mechanism gets
its mutant here, with the fastest tests that should kill it.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from mutation_verdict import VERDICT_ENV
from warm_pytest import WarmPytest


REPO = Path(__file__).parent.parent

STATE = "tests/test_state_dict.py::test_state_dicts_summon_and_wrap_time_broadcast_across_ranks"
STATE_ON_3 = f"{STATE}[3]"  # what only several ranks show
SWITCHES = "tests/test_switches.py::test_every_switch_does_what_it_says"
NO_COMPILER = "tests/test_switches.py::test_eager_steps_load_no_compiler"
EQUIVALENCE = "tests/test_equivalence.py::test_four_ranks_as_two_nodes_with_empty_parts"
KNOWN_ANSWER = "tests/test_equivalence.py::test_linear_regression_reaches_the_least_squares_answer_for_any_rank_count"
MEMORY = "tests/test_memory.py::test_only_the_computing_unit_holds_gathered_parameters"
NO_SYNC = "tests/test_memory.py::test_no_sync_holds_full_gradients_until_the_synced_backward"
COLLECTIVES = "tests/test_comm.py::test_collectives_on_several_ranks_for_every_dtype"
COLLECTIVES_ON_3 = f"{COLLECTIVES}[3]"  # a sum of 2 rounds once whatever its precision: 3 ranks tell them apart
COLLECTIVES_2X2 = f"{COLLECTIVES}[2x2]"  # 4 ranks as 2 nodes of 2: every collective in two levels
NAMES = "tests/test_equivalence.py::test_wrapped_models_generate_and_show_original_names"
STAGING_VARIABLE = "tests/test_comm.py::test_force_staging_variable_is_read_and_one_rank_stages_nothing"
MIXED = "tests/test_mixed_precision.py"
ONE_RANK = "tests/test_comm.py::test_one_rank_makes_no_mpi_call"
UNUSED = "tests/test_equivalence.py::test_parameters_that_no_rank_used_get_no_gradient"
STEP_IN_BACKWARD = "tests/test_equivalence.py::test_the_optimizer_stepped_inside_backward_makes_the_same_step_as_after_it"
EVERY_MODEL = "tests/test_equivalence.py::test_every_model_trains_as_on_one_process[2]"
ENTRY_POINTS = "tests/test_equivalence.py::test_any_entry_point_gathers_what_it_needs_and_matches_one_process"
FAMILIES = "tests/test_equivalence.py::test_a_layer_run_several_times_and_frozen_parts_train_as_on_one_process"
HOST_MEMORY = "tests/test_memory.py::test_freed_host_memory_is_kept_for_reuse_unless_turned_off"
HOST_MEMORY_KEPT, HOST_MEMORY_OFF, HOST_MEMORY_USERS = (
    f"{HOST_MEMORY}[{case}]" for case in ("--True", "0--False", "-glibc.malloc.mmap_threshold=33554432-False"))
POOL = "tests/test_memory.py::test_freed_gathered_memory_is_reused_unless_turned_off"
POOL_KEPT, POOL_OFF = f"{POOL}[-True]", f"{POOL}[0-False]"
PEAK_AS_SHIPPED = "tests/test_memory.py::test_a_steps_peak_with_the_allocator_as_shipped_is_the_state_and_one_units_work"
ARENA = "tests/test_memory.py::test_the_arena_places_each_block_lowest_first_and_merges_freed_space"
WRAPPED = "tests/test_memory.py::test_a_wrapped_model_gives_its_full_parameters_back_to_the_kernel"
DEFERRED = "tests/test_checkpoint.py::test_deferred_initialisation_equals_eager_construction_bit_for_bit[2]"
RESHARD = "tests/test_checkpoint.py::test_reshard_2_to_3_to_1_keeps_every_bit_and_continues_the_run"
RESUME = "tests/test_checkpoint.py::test_resume_on_the_same_ranks_continues_bit_for_bit"
RESHARD_FEWER = "tests/test_checkpoint.py::test_reshard_3_to_2_with_dropout_loads_every_bit_and_trains_on"
DAMAGE = "tests/test_checkpoint.py::test_a_damaged_file_is_named[corrupt]"
UNEVEN = "tests/test_hangs.py::test_uneven_steps_end_with_the_watchdog_report_after_the_timeout"
WATCHDOG = "tests/test_hangs.py::test_the_watchdog_reports_a_collective_that_outlasts_its_timeout"
STALLED = "tests/test_hangs.py::test_a_rank_stalled_outside_mpi_is_reported_alive"
UNIT_ORDER = "tests/test_hangs.py::test_verify_mode_names_the_ranks_and_units_that_diverge"
EVEN_BATCHES = "tests/test_hangs.py::test_even_batches_stops_every_rank_when_the_first_runs_out"
LAUNCHER = "tests/test_bad_input.py::test_an_experiment_started_as_n_one_rank_worlds_stops_before_writing"
STRATEGIES = "tests/test_strategies.py"
EVAL_RANKS = "tests/test_eval.py::test_two_ranks_evaluate_the_whole_split_as_one_process_does"
COST_COLLECTIVES = "tests/test_costmodel.py::test_each_strategy_issues_the_collectives_of_the_lifecycle"
MPI_LEFTOVERS = "tests/test_harness.py::test_a_session_removes_the_mpi_segments_it_left_that_nothing_maps"
PLACES = "tests/test_elastic.py::test_newcomers_start_on_their_nodes_host_where_it_keeps_a_survivor_and_in_free_slots_first"
INT8_STORAGE = "tests/test_eval.py::test_int8_stores_each_blocks_linear_weights_in_a_byte_and_keeps_the_tied_head"
INT8_ROUND_TRIP = "tests/test_compression.py::test_int8_round_trip_is_within_half_a_step_of_each_blocks_absmax"
NODE_DROPPED_LATE = "tests/test_resumable.py::test_a_run_that_lost_a_node_starts_again_at_once_on_the_nodes_left[137 n1 5]"
CONTROLLER_FAILS = "tests/test_resumable.py::test_a_controller_that_fails_now_and_then_changes_nothing"
SPLIT_DROPOUT = "tests/test_dropout.py::test_a_batch_split_any_way_draws_the_masks_of_the_whole_batch"
COMPILED_WHOLE = ("tests/test_equivalence.py::"
                  "test_a_compiled_model_trains_as_one_eager_process_in_the_graphs_of_the_unwrapped_model[3-compiled_whole]")
COMPILED = COMPILED_WHOLE.replace("[3-compiled_whole]", "[2-compiled]")  # inductor, one rank
BREAKS = ("tests/test_equivalence.py::"
          "test_a_compiled_model_breaks_its_graph_inside_a_unit_only_where_the_unwrapped_model_does")
TORCH_POLICIES = "tests/test_bad_input.py::test_torch_fsdp_wrap_policies_wrap_as_ours_and_anything_else_is_refused"
MOVING = ("tests/test_bad_input.py::"
          "test_moving_or_casting_a_wrapped_model_or_any_module_inside_is_refused_unless_it_changes_nothing")
STOPPED_BY_A_SIGNAL = ("tests/test_resume_experiments.py::"
                       "test_a_run_stopped_by_a_signal_on_one_rank_and_resumed_ends_as_if_never_stopped")
OTHER_RANKS = ("tests/test_resume_experiments.py::"
               "test_a_run_saved_on_two_ranks_continues_on_one_and_on_three_at_the_same_sample")
# The cost model's arithmetic, in one process (the cluster and compression tests measure the same on ranks).
LINK_BYTES = ("tests/test_costmodel.py::"
              "test_each_node_sends_the_closed_form_bytes_over_its_link_in_two_levels_and_in_one_ring")
COMPRESSED_WIRE_BYTES = "tests/test_costmodel.py::test_compressed_weights_travel_as_one_byte_codes_and_a_scale_per_block"
RANK_ORDER_SUM = "tests/test_compression.py::test_received_chunks_are_summed_in_fp32_in_rank_order"
NODE_PROTOCOL = "tests/test_node_transport.py::test_an_exchange_waits_writes_marks_meets_waits_reads_marks_in_turn"
NODE_FILES = "tests/test_shared_slots.py::test_nothing_is_left_in_dev_shm_and_a_failed_rank_ends_the_job_in_seconds[normal]"
NODE_FILES_NAMED = NODE_FILES.replace("[normal]", "[named]")
NODE_FILES_KILL_IN_GROWTH = NODE_FILES.replace("[normal]", "[kill-in-growth]")
OWN_READ = ("tests/test_shared_slots.py::"
            "test_a_rank_waits_for_every_ranks_read_of_a_slot_its_own_included_before_writing_it_again")
UNMAP_THEN_FREE = ("tests/test_shared_slots.py::"
                   "test_growth_frees_a_slot_only_after_every_rank_has_finished_with_it_and_unmapped_it")
GIVE_BACK = "tests/test_shared_slots.py::test_close_gives_the_device_memory_back_and_the_memory_column_counts_it_until_then"
EVENT_FILE = ("tests/test_shared_slots.py::"
              "test_the_drivers_event_file_is_removed_at_exit_and_before_an_abort_even_when_opening_the_events_fails")
INTEL_HINT = "tests/test_comm.py::test_under_intel_mpi_the_log_line_says_what_its_gpu_offload_would_change"
OFFLOAD_REFUSED = "tests/test_comm.py::test_intel_mpis_gpu_offload_without_a_cuda_driver_is_refused_before_mpi_starts"
CURRENT_DEVICE = "tests/test_cuda_ipc.py::test_the_runtime_calls_on_the_named_gpu_and_leaves_the_threads_current_device_as_it_was"
QUEUE_WAIT = "tests/test_worker.py::test_waiting_for_the_queue_waits_for_every_collective_then_raises_the_first_error"
WORKER_ORDER = "tests/test_worker.py::test_the_worker_runs_collectives_one_at_a_time_in_the_order_started"
CROSS_ENTROPY = "tests/test_cross_entropy.py::test_loss_and_gradient_are_torchs_on_the_fp32_logits"
SLABS = "tests/test_cross_entropy.py::test_no_fp32_tensor_of_all_the_logits_is_made_or_kept"
TORCH_DISTRIBUTED = ("tests/test_torch_distributed.py::"
                     "test_torch_fsdp2_hsdp_ddp_and_dtensor_train_as_one_process_on_the_fsdp_mpi_backend[2]")
KILLED_SAVE = "tests/test_checkpoint.py::test_a_rank_killed_while_saving_leaves_the_previous_checkpoint_whole"
TRUNCATED = "tests/test_checkpoint.py::test_a_damaged_file_is_named[truncate]"
PERSISTENT = "tests/test_memory.py::test_persistent_parameters_are_one_shard_per_rank[2]"
PREFETCH = "tests/test_memory.py::test_forward_prefetch_gathers_the_next_unit_while_one_computes"
STEP_PEAK = "tests/test_memory.py::test_a_steps_peak_holds_the_computing_unit_and_what_prefetch_started[no_prefetch-0]"
RECOMPUTED = "tests/test_memory.py::test_a_forward_recomputed_in_backward_gathers_nothing_more"
CODEC_CHUNKS = "tests/test_compression.py::test_codecs_working_a_chunk_of_columns_at_a_time_give_the_bits_of_whole_rows"
VOCABULARY = "tests/test_models.py::test_the_padded_vocabulary_never_shows_in_logits_loss_samples_or_gradients"
EXPORT = "tests/test_checkpoint.py::test_export_streams_hugging_face_files_that_load_anywhere"
NODE_LOST = "tests/test_resumable.py::test_a_run_that_lost_a_node_starts_again_at_once_on_the_nodes_left"
BOUND_GROUP = ("tests/test_torch_distributed.py::"
               "test_a_group_bound_to_a_device_answers_for_its_backend_there_and_splits")
LIGHTNING = "tests/test_lightning.py::test_lightning_trainer_with_fsdp_mpi_matches_one_process_resumes_and_mixes_precision"
DOWNLOAD = "tests/test_data.py::test_a_download_is_written_only_as_published[truncated]"
DIRECT_ORDER = "tests/test_comm.py::test_the_direct_route_waits_for_the_stream_before_mpi_touches_any_piece"

# name: (file, the line's text as it is, what it becomes, tests that must fail)
MUTANTS = {
    "values copied into shards come from the wrong elements": (
        "fsdp_mpi/sharding/flat_param.py", "full_value.reshape(-1)[start:start + slot.shard_stop - slot.shard_start])",
        "full_value.reshape(-1).flip(0)[start:start + slot.shard_stop - slot.shard_start])", [STATE]),
    "deferred init ignores rank 0's generator": (
        "fsdp_mpi/sharding/deferred_init.py", "torch.set_rng_state(comm.all_gather_object(torch.get_rng_state())[0])",
        "torch.get_rng_state()", [DEFERRED]),
    "checkpoint pieces read back to front": (
        "fsdp_mpi/files/checkpoint.py", "get_slice(key)[lo - piece_start:hi - piece_start])",
        "get_slice(key)[lo - piece_start:hi - piece_start].flip(0))", [RESHARD]),
    "resume leaves the random generators alone": (
        "fsdp_mpi/files/checkpoint.py", '_set_rng_states(state["rng"][comm.rank])', "pass", [RESUME]),
    "checksums not verified": (
        "fsdp_mpi/files/checkpoint.py", 'if sha256(path) != expected["sha256"]:', "if False:", [DAMAGE]),
    "summon never writes back": (
        "fsdp_mpi/sharding/flat_param.py", "self.shard.copy_(full[self.shard_offset:self.shard_offset + self.shard_numel])",
        "pass", [STATE]),
    "bad state dict is loaded before the check": (
        "fsdp_mpi/sharding/state_dict.py", "    if problems:\n        raise", "    if False:\n        raise", [STATE]),
    "summon without writeback keeps edits": (
        "fsdp_mpi/sharding/state_dict.py", "            if writeback:\n", "            if True:\n", [STATE]),
    "no broadcast of rank 0's weights": (
        "fsdp_mpi/sharding/fully_sharded.py", "if sync_module_states:", "if False:", [STATE_ON_3]),
    "end of backward reduces nothing": (
        "fsdp_mpi/sharding/lifecycle.py", "if unit.requires_gradient_sync and (handle.gradient.awaiting",
        "if False and (handle.gradient.awaiting", [UNUSED]),
    "SHARD_GRAD_OP frees after forward": (
        "fsdp_mpi/sharding/lifecycle.py", "return self.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP or self.is_root",
        "return self.is_root", [SWITCHES]),
    "backward prefetch does nothing": (
        "fsdp_mpi/sharding/lifecycle.py", 'if self.overlap.backward_prefetch and', "if False and", [SWITCHES]),
    "async reduce-scatter waits at once": (
        "fsdp_mpi/sharding/lifecycle.py", 'asynchronous = self.overlap.async_reduce_scatter', "asynchronous = False",
        [SWITCHES]),
    "checkpointing never recomputes": (
        "models/gpt2.py", "if self.gradient_checkpointing and self.training", "if False and self.training",
        [SWITCHES]),
    "no gradient communication": (
        "fsdp_mpi/sharding/collectives.py", "        self.comm.reduce_scatter_sum(shard_grad, full_grad.contiguous(), unit)",
        "        shard_grad.copy_(full_grad.view(self.comm.world_size, -1)[self.comm.rank])",
        [KNOWN_ANSWER]),
    "torch's wrap policy never asked whether to look inside": (
        "fsdp_mpi/sharding/wrap.py", "            if not policy.should_descend(child, numel):",
        "            if False:", [TORCH_POLICIES]),
    "gradients summed, not averaged": (
        "fsdp_mpi/sharding/flat_gradient.py", "self.scale = 1 / divisor if self.scale_in_backward else 1.0",
        "self.scale = 1.0", [EQUIVALENCE]),
    "compiled, gradients summed, not averaged": (
        "fsdp_mpi/sharding/traced.py", "(grad.reshape(-1) if scale == 1.0 else grad.reshape(-1) * scale)",
        "grad.reshape(-1)", [COMPILED_WHOLE]),
    "16-bit gradients summed, not averaged": (
        "fsdp_mpi/sharding/flat_gradient.py", "            shard_grad.div_(self.divisor)", "            pass", [EQUIVALENCE]),
    "gradient reduced into the wrong shard": (
        "fsdp_mpi/sharding/collectives.py", "        self.comm.reduce_scatter_sum(shard_grad, full_grad.contiguous(), unit)",
        "        self.comm.reduce_scatter_sum(shard_grad, full_grad.roll(-shard_grad.numel()).contiguous(), unit)",
        [EQUIVALENCE]),
    "reshard frees nothing": (
        "fsdp_mpi/sharding/flat_param.py", "        if self.is_unsharded and not self.aliases_shard:\n            self._free_full_storage()",
        "        if False:\n            self._free_full_storage()", [MEMORY]),
    "clipping ignores other ranks": (
        "fsdp_mpi/loop/clip.py", "total = local if comm.world_size == 1 else over_ranks(local.item())", "total = local",
        [EQUIVALENCE]),
    "no_sync still reduces": (
        "fsdp_mpi/sharding/lifecycle.py", "        if self.requires_gradient_sync:\n            asynchronous",
        "        if True:\n            asynchronous", [NO_SYNC]),
    "zero_grad does not release the sharded gradient": (
        "fsdp_mpi/sharding/flat_gradient.py", "if len(cleared) == len(holding):", "if False:", [NO_SYNC]),
    "wrapper names leak into named_parameters": (
        "fsdp_mpi/sharding/fully_sharded.py", "yield original_name(name), param", "yield name, param", [NAMES]),
    "every forward's views keep the first step's autograd node": (
        "fsdp_mpi/sharding/flat_param.py", "if new_forward and self.requires_grad and torch.is_grad_enabled():",
        "if new_forward and self.requires_grad and torch.is_grad_enabled() and self._full_views[0].grad_fn is None:",
        [STEP_PEAK]),
    "gathered views stay after reshard": (
        "fsdp_mpi/sharding/flat_layout.py", "            owner.__dict__.pop(attribute, None)", "            pass", [NAMES]),
    "forced staging copies nothing through the host": (
        "fsdp_mpi/communication/transports/direct.py", 'return not comm.force_staging and (device.type == "cpu" or comm.cuda_aware)',
        'return device.type == "cpu" or comm.cuda_aware', [COLLECTIVES]),
    "staged chunks land in the wrong place": (
        "fsdp_mpi/communication/transports/staged.py", "pipeline.copy_in(full_by_rank[:, a:b],",
        "pipeline.copy_in(full_by_rank[:, :b - a],", [COLLECTIVES]),
    "parameters no rank used keep a zero gradient": (
        "fsdp_mpi/sharding/lifecycle.py", "            self._drop_gradients_no_rank_used()", "            pass", [UNUSED]),
    "a parameter used on one rank only loses its gradient": (
        "fsdp_mpi/sharding/lifecycle.py", 'self.comm.all_reduce_sum_(flags, "<which parameters got gradients>")', "pass",
        [UNUSED]),
    "a part called alone leaves its unit gathered": (
        "fsdp_mpi/sharding/lifecycle.py", "            self._post_forward(part, args, output)\n", "", [ENTRY_POINTS]),
    "frozen parameters share a flat buffer with trained ones": (
        "fsdp_mpi/sharding/flat_layout.py", "groups.setdefault((param.dtype, param.requires_grad), [])",
        "groups.setdefault((param.dtype,), [])", [FAMILIES]),
    "accumulating sharded gradients keeps the last micro-batch's": (
        "fsdp_mpi/sharding/flat_gradient.py", "            self.shard_grad += shard_grad", "            self.shard_grad = shard_grad",
        [EQUIVALENCE]),
    "one rank gathers through MPI": (
        "fsdp_mpi/communication/routes.py", "        if one_rank.transport is not None:", "        if False:", [ONE_RANK]),
    "started staged collectives complete before start returns": (
        "fsdp_mpi/communication/comm.py",
        "self.communication_thread = CommunicationThread() if threads_may_call_mpi_at_once() else None",
        "self.communication_thread = None", [COLLECTIVES]),
    "FSDP_MPI_FORCE_STAGING is ignored": (
        "fsdp_mpi/communication/comm.py", "read_flag(FORCE_STAGING) if force_staging is None",
        "False if force_staging is None", [STAGING_VARIABLE]),
    "the loss scaler decides on each rank alone": (
        "fsdp_mpi/loop/grad_scaler.py", "self.comm.all_reduce_max_float(float(found_here)) > 0", "found_here", [MIXED]),
    "state dicts save the masters rounded to the compute dtype": (
        "fsdp_mpi/sharding/flat_param.py", "        self.comm.all_gather_into(full, self.shard, self.unit_name)\n        return full\n",
        "        self.comm.all_gather_into(full, self.shard, self.unit_name)\n"
        "        return full.to(self.param_dtype or full.dtype).to(full.dtype)\n", [MIXED]),
    "freed host memory goes back to the kernel": (
        "fsdp_mpi/sharding/host_memory.py",
        'if _decided or read_flag(REUSE_HOST_MEMORY) is False or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):',
        "if True:", [HOST_MEMORY_KEPT]),
    "FSDP_MPI_REUSE_HOST_MEMORY=0 is ignored": (
        "fsdp_mpi/sharding/host_memory.py",
        'if _decided or read_flag(REUSE_HOST_MEMORY) is False or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):',
        'if _decided or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):', [HOST_MEMORY_OFF]),
    "the user's malloc tunables are overridden": (
        "fsdp_mpi/sharding/host_memory.py",
        'if _decided or read_flag(REUSE_HOST_MEMORY) is False or "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):',
        "if _decided or read_flag(REUSE_HOST_MEMORY) is False:", [HOST_MEMORY_USERS]),
    "the model's full parameters stay in the heap once the shards replace them": (
        "fsdp_mpi/sharding/fully_sharded.py",
        "            give_back_freed_host_memory()  # the model's full parameters, which the shards replaced",
        "            pass", [WRAPPED]),
    "freed space in the arena does not merge with the free space above it": (
        "fsdp_mpi/sharding/host_allocator.cpp", "if (after != free_.end() && after->first == start + bytes) {",
        "if (false) {", [ARENA]),
    "the arena gives a freed block's pages back to the kernel at once": (
        "fsdp_mpi/sharding/host_allocator.cpp", "    in_use_bytes_ -= bytes;\n",
        "    in_use_bytes_ -= bytes;\n    madvise(address, bytes, MADV_DONTNEED);\n", [HOST_MEMORY_KEPT]),
    "freed gathered memory goes back to the allocator": (
        "fsdp_mpi/sharding/host_memory.py", "self._free[kept.nbytes()].append(kept)", "kept = None",
        [POOL_KEPT]),
    "the pool ignores FSDP_MPI_REUSE_HOST_MEMORY=0": (
        "fsdp_mpi/sharding/host_memory.py", 'device.type == "cpu" and read_flag(REUSE_HOST_MEMORY) is not False',
        'device.type == "cpu"', [POOL_OFF]),
    "a full gradient's memory is freed, not given back for reuse": (
        "fsdp_mpi/sharding/host_memory.py", "            self.buffers.drain(self.storage)",
        "            self.storage.resize_(0)", [PEAK_AS_SHIPPED]),
    "the watchdog never fires": (
        "fsdp_mpi/communication/failures/collective_log.py", "if waited >= timeout - asking:",
        "if False:", [WATCHDOG]),
    "no rank answers the watchdog's question": (
        "fsdp_mpi/communication/failures/liveness.py", "while self._question.Test():",
        "while False:", [STALLED]),
    "verify mode compares nothing": (
        "fsdp_mpi/communication/bookkeeping.py", "if extremes[0] == -extremes[1]:", "if True:", [UNIT_ORDER]),
    "verify mode ignores which unit": (
        "fsdp_mpi/communication/failures/collective_log.py", 'return f"{self.sequence}|{self.operation}|{self.unit}|',
        'return f"{self.sequence}|{self.operation}|', [UNIT_ORDER]),
    "even_batches stops only the rank that ran out": (
        "fsdp_mpi/loop/even_batches.py", "if comm.all_reduce_min_float(float(has_batch)) == 0.0:", "if not has_batch:",
        [EVEN_BATCHES]),
    "a launcher mismatch goes unnoticed": (
        "fsdp_mpi/communication/failures/launcher.py", "if value.isdigit() and int(value) > 1:",
        "if False:", [LAUNCHER]),
    "replicas never average their gradients": (
        "fsdp_mpi/sharding/collectives.py", "        if self.replicas is not None:\n            self.replicas.all_reduce_sum_(",
        "        if False:\n            self.replicas.all_reduce_sum_(", [STRATEGIES]),
    "clipping sums the norm over replicas too": (
        "fsdp_mpi/loop/clip.py", "comm = units[0][1].groups.shard", "comm = units[0][1].comm", [STRATEGIES]),
    "validation reports one rank's share": (
        "experiments/training/evaluation.py", "comm.all_reduce_sum_(torch.from_numpy(summed))", "pass", [EVAL_RANKS]),
    "int8 quantizes nothing": (
        "experiments/eval.py", "return torch.ao.quantization.quantize_dynamic(model, untied, dtype=torch.qint8, inplace=True)",
        "return model", [INT8_STORAGE]),
    "the bench's first step, which holds a compile, is one of the timed steps": (
        "experiments/measuring/bench_worker.py", "parts)), times[0],", "parts)), times[args.warmup],",
        ["tests/test_bench.py::test_the_first_step_is_reported_apart_from_the_timed_ones"]),
    "a bench cut short by a GPU's time limit loses every run it finished": (
        "experiments/bench.py", "            bench_report.write_csv(rounds_out, log, ROUND_FIELDS, args)\n", "",
        ["tests/test_bench.py::test_each_run_is_written_as_it_ends_so_that_a_bench_cut_short_keeps_it"]),
    "naming a group of the GPU check runs none of its steps": (
        "hpc/gpu_check.sh", '[[ "$only" != *" $1 "* ]] || only="$only ${*:2} "', "true",
        ["tests/test_gpu_check.py::test_the_dry_form_prints_every_named_step_and_runs_nothing"]),
    "a test run given the tests that passed before runs them again": (
        "tests/conftest.py", "left_out = {item for item in items if item.nodeid in PASSED_BEFORE}", "left_out = set()",
        ["tests/test_harness.py::test_a_run_cut_short_goes_on_with_the_tests_that_had_not_passed"]),
    "the MPI segments a killed rank left stay in /dev/shm": (
        "tests/harness/mpi_leftovers.py", "            path.unlink()\n", "            pass\n", [MPI_LEFTOVERS]),
    "the session's end removes an MPI segment a live job maps": (
        "tests/harness/mpi_leftovers.py", " or str(path) in in_use", "", [MPI_LEFTOVERS]),
    # (No mutant of the rank servers' code, harness/warm_ranks.py: a session's mutant runs use the servers it
    # started from the tree as it is, so a mutant there changes nothing once one launch came before.)
    "every newcomer goes to free slots, though the node of the rank it replaces keeps a survivor": (
        "fsdp_mpi/communication/failures/job.py",
        "places.setdefault(node[0] if node[0] is not None and node in alive_nodes else None, []).append(rank)",
        "places.setdefault(None, []).append(rank)", [PLACES]),
    "newcomers go onto their hosts before the free slots' are spawned, taking those slots from them": (
        "fsdp_mpi/communication/failures/job.py", "key=lambda host: (host is not None, host or \"\"))]",
        "key=lambda host: (host is None, host or \"\"))]", [PLACES]),
    "the cost model forgets the backward all-gather": (
        "experiments/measuring/costmodel.py", "if g > 1 and regathers and not unit.is_root:", "if False:", [COST_COLLECTIVES]),
    "split communicators count their traffic nowhere": (
        "fsdp_mpi/communication/comm.py", "child.traffic, child.node_exchange_bytes = self.traffic, self.node_exchange_bytes",
        "child.node_exchange_bytes = self.node_exchange_bytes", [STRATEGIES]),
    "the node transport's reduce-scatter sums every peer's own row instead of this rank's": (
        "fsdp_mpi/communication/transports/node.py", "else _blocks(peer(rank), parts.dtype, self.world, rows, b - a)[self.rank]",
        "else _blocks(peer(rank), parts.dtype, self.world, rows, b - a)[rank]", [COLLECTIVES]),
    "the node transport's 16-bit sums accumulate in 16 bits": (
        "fsdp_mpi/communication/machinery/sums.py", "total = parts[0].to(torch.float32 if summed_in_fp32(out.dtype) else out.dtype, copy=True)",
        "total = parts[0].clone()", [COLLECTIVES_ON_3]),
    "the node transport's exchanges all use slot 0": (
        "fsdp_mpi/communication/transports/node.py", "slot, self._next_slot = self._next_slot, 1 - self._next_slot",
        "slot, self._next_slot = 0, 0", [NODE_PROTOCOL]),
    "a rank reads its peers' slots without waiting for their writes (on a GPU: their events)": (
        "fsdp_mpi/communication/transports/node.py", "        slots.wait_until_written(slot)",
        "        pass", [NODE_PROTOCOL]),
    "the host slots' file is left in /dev/shm": (
        "fsdp_mpi/communication/transports/shared_slots.py", "os.unlink(path)  # every rank has mapped it, or failed: the memory lives as long as the mappings",
        "pass", [NODE_FILES_NAMED]),
    "the host slots' memory is a named file even where it need not be": (
        "fsdp_mpi/communication/transports/shared_slots.py", 'descriptor = os.memfd_create("fsdp_mpi-slots", os.MFD_CLOEXEC)',
        'raise OSError("no memfd")', [NODE_FILES_KILL_IN_GROWTH]),
    "a rank rewrites its slot before its own read of it is done (on a GPU: its own event)": (
        "fsdp_mpi/communication/transports/shared_slots.py", "        for events in self._reads_by_rank.values():",
        "        for events in [e for r, e in self._reads_by_rank.items() if r != self.rank]:", [OWN_READ]),
    "a rank frees its device slots before its peers have unmapped them": (
        "fsdp_mpi/communication/transports/shared_slots.py", "        _agree(self.mpi_comm, unmap_peers)\n        _agree(self.mpi_comm, free_own)",
        "        free_own()\n        _agree(self.mpi_comm, unmap_peers)", [UNMAP_THEN_FREE]),
    "closing the device slots gives nothing back": (
        "fsdp_mpi/communication/transports/shared_slots.py", "if self._allocation is None and not self._opened:",
        "if True:", [GIVE_BACK]),
    "the driver's event file is left when opening the peers' events fails": (
        "fsdp_mpi/communication/transports/shared_slots.py", "        _remove_the_drivers_event_file_at_exit()\n        handles = mpi_comm.allgather",
        "        handles = mpi_comm.allgather", [EVENT_FILE]),
    "the node's memory grows at the first large collective, not when the model is wrapped": (
        "fsdp_mpi/sharding/fully_sharded.py", "            _reserve_node_memory(self._unit.context.units, _groups)",
        "            pass", [NODE_FILES]),
    "Intel MPI's line gives the generic hint, not its offload setting": (
        "fsdp_mpi/communication/machinery/mpi_library.py", "    elif is_intel_mpi():",
        "    elif False:", [INTEL_HINT]),
    "Intel MPI's offload without a CUDA driver is left to crash MPI_Init": (
        "fsdp_mpi/communication/failures/launcher.py", "    if not intel_mpi_offload_is_on():\n        return",
        "    if True:\n        return", [OFFLOAD_REFUSED]),
    "two levels put each local rank's rows where another's go": (
        "fsdp_mpi/communication/machinery/placement.py",
        "return rows.view(self.nodes, self.per_node, *rows.shape[1:]).transpose(0, 1)",
        "return rows.view(self.per_node, self.nodes, *rows.shape[1:])", [COLLECTIVES_2X2]),
    "two levels round a node's 16-bit sums before adding the nodes'": (
        "fsdp_mpi/communication/transports/two_level.py",
        "wide = torch.float32 if summed_in_fp32(shard.dtype) else shard.dtype", "wide = shard.dtype",
        [COLLECTIVES_2X2]),
    "a group that spans nodes goes in one flat ring": (
        "fsdp_mpi/communication/transports/two_level.py", "if layout is None or not comm.two_level:", "if True:",
        [COLLECTIVES_2X2]),
    "the cost model sends a flat ring's bytes across nodes where two levels go": (
        "experiments/measuring/costmodel.py",
        'return {"all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n * collective.widened,',
        'return {"all_gather": (p - 1) / p, "reduce_scatter": (n - 1) / n * collective.widened,', [LINK_BYTES]),
    "a CUDA call leaves the thread on another GPU": (
        "fsdp_mpi/communication/transports/cuda_ipc.py", "            self._library.cudaSetDevice(previous.value)",
        "            pass", [CURRENT_DEVICE]),
    "the fsdp_mpi backend's AVG sums without dividing by the ranks": (
        "fsdp_mpi/distributed/reductions.py", "        if self.kind != _OP.AVG or summed_in_fp32(tensor.dtype):",
        "        if True:", [TORCH_DISTRIBUTED]),
    "a quantizer that ignores the scale": (
        "fsdp_mpi/communication/compression.py", "codes = (blocks / divisors).round_()", "codes = blocks.clone().round_()",
        [INT8_ROUND_TRIP]),
    "the cost model sends the whole buffer across nodes in a ring all-gather": (
        "experiments/measuring/costmodel.py", '"all_gather": (p - 1) / p,', '"all_gather": 1.0,', [LINK_BYTES]),
    "the cost model prices int8 as uncompressed": (
        "experiments/measuring/costmodel.py", 'if form == "int8":', "if False:", [COMPRESSED_WIRE_BYTES]),
    "codec chunks cut int8 blocks": (
        "fsdp_mpi/communication/compression.py", "max(multiple, CHUNK_ELEMENTS // count // multiple * multiple)",
        "max(1, CHUNK_ELEMENTS // count)", [CODEC_CHUNKS]),
    "compressed gradients summed in low precision": (
        "fsdp_mpi/communication/machinery/sums.py", "total = parts[0].to(torch.float32 if summed_in_fp32(out.dtype) else out.dtype, copy=True)",
        "total = parts[0].to(out.dtype, copy=True)", [RANK_ORDER_SUM]),
    "staged reduce-scatter sends every chunk's columns from the first chunk": (
        "fsdp_mpi/communication/transports/staged.py", "full_by_rank[:, a:b]),\n",
        "full_by_rank[:, :b - a]),\n", [COLLECTIVES]),
    "staged all-to-all lands every chunk in the first columns": (
        "fsdp_mpi/communication/transports/staged.py", "pipeline.copy_in(received_by_rank[:, a:b],",
        "pipeline.copy_in(received_by_rank[:, :b - a],", [COLLECTIVES]),
    "staged in-place collectives copy the ring's first slot back for every chunk": (
        "fsdp_mpi/communication/transports/staged.py", "pipeline.copy_in(tensor[a:b], host(i, a, b))",
        "pipeline.copy_in(tensor[a:b], host(0, a, b))", [COLLECTIVES]),
    "every staged chunk goes through the ring's first slot": (
        "fsdp_mpi/communication/transports/staged.py", "slot = i % RING_SLOTS",
        "slot = 0", [COLLECTIVES]),
    "a reduce-scatter cut into messages sends the first message's columns each time": (
        "fsdp_mpi/communication/transports/direct.py", "piece = full_by_rank[:, a:b].contiguous()",
        "piece = full_by_rank[:, :b - a].contiguous()", [COLLECTIVES]),
    "broadcast_ through MPI sends rank 0's tensor whatever the root": (
        "fsdp_mpi/communication/transports/direct.py", "self.mpi.broadcast(flat[a:b], root)",
        "self.mpi.broadcast(flat[a:b], 0)", [COLLECTIVES]),
    "after a failed collective the communication thread's later ones are not waited for": (
        "fsdp_mpi/communication/machinery/worker.py", "        wait(queued)\n",
        "", [QUEUE_WAIT]),
    "a save removes the previous checkpoint before the new one is complete": (
        "fsdp_mpi/files/checkpoint.py", 'temporary = directory.with_name(directory.name + ".tmp")',
        'temporary = directory.with_name(directory.name + ".tmp"); __import__("shutil").rmtree(directory, True)',
        [KILLED_SAVE]),
    "the communication thread runs several collectives at once": (
        "fsdp_mpi/communication/machinery/worker.py",
        "                future.set_result(self._run(collective, ready, side))",
        "                threading.Thread(target=lambda f=future, c=collective, r=ready, s=side: f.set_result("
        "self._run(c, r, s))).start()", [WORKER_ORDER]),
    "a collective on the main thread does not wait for those handed to the worker": (
        "fsdp_mpi/communication/machinery/worker.py", "if not self._queued or threading.current_thread() is self._worker:",
        "if True:", [WORKER_ORDER]),
    "a started 16-bit reduce-scatter is cast to fp32 by the worker": (
        "fsdp_mpi/communication/comm.py", "            shard, full, finish = transport.widened_for_sum(shard, full)",
        "            pass", [COLLECTIVES]),
    "a truncated file is not told from a corrupted one": (
        "fsdp_mpi/files/checkpoint.py", 'if path.stat().st_size != expected["bytes"]:', "if False:", [TRUNCATED]),
    "rank0_only state dicts are full on every rank": (
        "fsdp_mpi/sharding/state_dict.py", "keep = not rank0_only or units[0][1].comm.rank == 0", "keep = True",
        [STATE_ON_3]),
    "the post-backward hook holds its unit strongly, so a dropped model's shards live on": (
        "fsdp_mpi/sharding/lifecycle.py", "unit_ref, handle_ref = weakref.ref(unit), weakref.ref(handle)",
        "unit_ref, handle_ref = (lambda: unit), (lambda: handle)", [PERSISTENT]),
    "forward prefetch gathers nothing ahead": (
        "fsdp_mpi/sharding/lifecycle.py",
        'if self.overlap.forward_prefetch and (upcoming := order.after(self)) is not None:',
        "if False:", [PREFETCH]),
    "a unit's forward hook is hidden from dynamo again, breaking a compiled model's graph at every unit": (
        "fsdp_mpi/sharding/lifecycle.py", "    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict)",
        "    @torch.compiler.disable\n    def _pre_forward(self, module: nn.Module, args: tuple, kwargs: dict)",
        [COMPILED_WHOLE]),
    "compiled, a frame of the wrapper's lies between the model's: a break inside a unit costs one more": (
        "fsdp_mpi/sharding/fully_sharded.py", "            return self.module.__call__",
        "            return self._call_wrapped", [BREAKS]),
    "the hooks' own frames are compiled: the root's gather is a graph of its own, its unused get zeros": (
        "fsdp_mpi/sharding/traced.py", "    _EAGER_AS_FRAMES.append(function.__code__)", "    pass", [COMPILED_WHOLE]),
    "torch.compile(model) runs the root's hooks before anything marked them for dynamo": (
        "fsdp_mpi/sharding/fully_sharded.py", "        mark_eager_frames_for_dynamo()\n", "        pass\n",
        [COMPILED_WHOLE]),
    "compiled on one rank, the eager end of backward drops the gradients the graph gave": (
        "fsdp_mpi/sharding/traced.py", "        handle.gradient.reduced_in_graph = True", "        pass", [COMPILED]),
    "an eager hook that compiled code must not trace loads the compiler at its first call": (
        "fsdp_mpi/sharding/traced.py", 'if "torch._dynamo" not in sys.modules:', "if False:", [NO_COMPILER]),
    "compiled, the views' autograd function is not put in the graph as it is: dynamo breaks at it": (
        "fsdp_mpi/sharding/traced.py", "    torch._dynamo.allow_in_graph(_full_views)", "    pass", [COMPILED_WHOLE]),
    "compiled, a gradient that only no_sync gave, which the synced graph cannot hand over, is dropped": (
        "fsdp_mpi/sharding/flat_gradient.py", "            view.grad = piece if view.grad is None else view.grad.add_(piece)",
        "            pass", [UNUSED]),
    "an eager end of backward inside a compiled step drops the gradients the graph gave": (
        "fsdp_mpi/sharding/lifecycle.py", "if handle.requires_grad and not handle.gradient.reduced_in_graph]",
        "if handle.requires_grad]", [UNUSED]),
    "an eager reduction after a compiled one forgets the gradients the graph gave": (
        "fsdp_mpi/sharding/flat_gradient.py", "                    piece += view.grad", "                    pass",
        [UNUSED]),
    "offloaded shards are pinned, and stepped on a host thread, where the units compute on the CPU too": (
        "fsdp_mpi/sharding/offload.py", 'return self.offload_params and compute_device.type != "cpu"',
        "return self.offload_params", ["tests/test_switches.py::test_offload_pins_and_copies_only_where_units_compute_on_a_gpu"]),
    "the experiments' --step-in-backward never steps inside backward (nor after it)": (
        "experiments/training/loop.py", "stepping = last and config.step_in_backward", "stepping = False",
        ["tests/test_experiments.py::test_a_run_stepping_inside_backward_trains_as_the_same_run_stepping_after_and_says_so"]),
    "inside backward, a handle steps before the ranks agreed which of its parameters got no gradient": (
        "fsdp_mpi/loop/step_in_backward.py", "        if all(handle.gradient.received):", "        if True:",
        [STEP_IN_BACKWARD]),
    "inside backward, every handle waits for the end of backward: nothing overlaps": (
        "fsdp_mpi/loop/step_in_backward.py", "        if all(handle.gradient.received):", "        if False:",
        [STEP_IN_BACKWARD]),
    "inside backward, a handle stepped inline keeps its gradient until the end of backward": (
        "fsdp_mpi/loop/step_in_backward.py", "            _clear_gradient(handle)  # its memory is free for the rest of backward\n",
        "            pass\n", [STEP_IN_BACKWARD]),
    "clipping after the optimizer stepped inside backward clips nothing, silently": (
        "fsdp_mpi/loop/clip.py", "    if units[0][1].root.context.stepped_in_backward:", "    if False:",
        [STEP_IN_BACKWARD]),
    "a module inside a unit may be cast apart from its shards": (
        "fsdp_mpi/sharding/lifecycle.py", "refuse_moving_or_casting([module, *parts], self.handles)",
        "refuse_moving_or_casting([module], self.handles)", [MOVING]),
    "a run resumed on other ranks takes its global batch from them": (
        "experiments/training/loop.py",
        "(directory.read_started_on() if is_newcomer() else directory.started_on()) or started_on", "started_on",
        [OTHER_RANKS]),
    "a Lightning requeue saves inside gradient accumulation, losing a step's first micro-batches": (
        "fsdp_mpi/lightning_requeue.py",
        "        if pl_module.automatic_optimization and trainer.fit_loop.epoch_loop._should_accumulate():",
        "        if False:", [LIGHTNING]),
    "under fit_elastic a requeue saves Lightning's own file, so the requeued job repeats steps": (
        "fsdp_mpi/lightning_elastic.py", "    strategy.requeue_saves = checkpoints.save_now\n", "", [LIGHTNING]),
    "every rank asks scontrol to requeue the job under Lightning": (
        "fsdp_mpi/lightning_requeue.py", "        if self.comm.rank == 0:", "        if True:", [LIGHTNING]),
    "offloaded, a step inside backward reads its gradient before it has come home": (
        "fsdp_mpi/loop/step_in_backward.py", "        handle.gradient.wait_for_arrival()\n", "", [STEP_IN_BACKWARD]),
    "offloaded, a second reduction meets the first on the host before either has come home": (
        "fsdp_mpi/sharding/flat_gradient.py",
        "        if self.shard_grad is not None or any(view.grad is not None for view in views):",
        "        if False:", [EVERY_MODEL]),
    "offloaded, backward ends before the gradients have come home": (
        "fsdp_mpi/sharding/lifecycle.py", "                handle.gradient.wait_for_arrival()  #", "                #",
        [STEP_IN_BACKWARD]),
    "a rank that stopped with its checkpoint dies of the SIGTERM that srun sends as the first rank exits": (
        "fsdp_mpi/loop/stop_signals.py", "            signal.signal(stop_signal, signal.SIG_IGN)", "            pass",
        [STOPPED_BY_A_SIGNAL]),
    "a rank's share of a step starts at the step's first sample whatever its rank": (
        "experiments/training/sampling.py", "mine = order[first + rank:last:world]", "mine = order[first:last:world]",
        ["tests/test_data.py"]),
    "a forward recomputed in backward is taken for a new forward": (
        "fsdp_mpi/sharding/lifecycle.py", "        if self.state is TrainingState.BACKWARD:\n            self._to_backward()",
        "        if False:\n            self._to_backward()", [RECOMPUTED]),
    "the vocabulary's padding takes part in the softmax": (
        "models/vocabulary.py", '        mask[self.vocab_size:] = float("-inf")', "        pass", [VOCABULARY]),
    "the loss's gradient leaves out the target's one-hot": (
        "models/cross_entropy.py", "            softmax.scatter_add_(", "            softmax.clone().scatter_add_(",
        [CROSS_ENTROPY]),
    "the loss takes twice the rows a slab should have in fp32": (
        "models/cross_entropy.py", "SLAB_BYTES // (4 * vocab)", "SLAB_BYTES // (2 * vocab)", [SLABS]),
    "loading into shards leaves the padding rows as they were": (
        "fsdp_mpi/files/pretrained.py", "            param.view[stored - start:].zero_()", "            pass", [EXPORT]),
    "the direct route hands MPI a fresh piece before the stream has run": (
        "fsdp_mpi/communication/transports/direct.py", "wait_for_producer(gathered)", "None", [DIRECT_ORDER]),
    "a job that lost a node is not continued on the nodes left": (
        "hpc/resumable.sh", '[ -n "$left" ] && [ "$left" != "$nodes" ] || break', "break", [NODE_LOST]),
    "a process group answers for no device's backend": (
        "fsdp_mpi/distributed/process_group.py",
        "    def _get_backend(self, device: torch.device) -> \"MpiProcessGroup\":\n        return self\n",
        "", [BOUND_GROUP]),
    "a torch group lists no device it has a backend for": (
        "fsdp_mpi/distributed/process_group.py", "        return [torch.device(kind) for kind in DEVICE_TYPES]",
        "        return []", [BOUND_GROUP]),
    "an error on a torch group's communication thread never completes its work": (
        "fsdp_mpi/distributed/work.py", "            self._future.set_exception(error)", "            raise",
        [TORCH_DISTRIBUTED]),
    "a message shorter than its receiving tensor is taken as it came": (
        "fsdp_mpi/communication/point_to_point.py", "if status.Get_count(MPI.BYTE) != received.nbytes:", "if False:",
        [TORCH_DISTRIBUTED]),
    "a collective of no elements goes to its transport": (
        "fsdp_mpi/communication/comm.py", "        if buffer.numel() == 0:\n            return\n", "", [COLLECTIVES_2X2]),
    "a download is written without its check": (
        "experiments/corpora/files.py", "    wrong = PINS[relative].mismatch(payload)", "    wrong = None", [DOWNLOAD]),
    "a one-file checkpoint's optimizer state has each rank's pieces back to front": (
        "fsdp_mpi/files/optimizer_state.py", "shard[p.slot.shard_start:p.slot.shard_stop].copy_(piece)",
        "shard[p.slot.shard_start:p.slot.shard_stop].copy_(piece.flip(0))", [RESHARD_FEWER]),
    "a fitted module set up again by a Trainer asking for other settings trains on with its old ones": (
        "fsdp_mpi/sharding/fully_sharded.py", "        if differences:\n", "        if False:\n", [LIGHTNING]),
    "the Lightning strategy restores after setup, where Lightning drops the user's weights_only": (
        "fsdp_mpi/lightning.py", 'once it is built."""\n        return False', 'once it is built."""\n        return True',
        [LIGHTNING]),
    "Lightning's teardown moves the sharded model to the CPU": (
        "fsdp_mpi/lightning.py", "        self.cluster_environment.teardown()", "        super().teardown()", [LIGHTNING]),
    "a crashed node the controller still lists ends the job": (
        "hpc/resumable.sh", "deadline=$((SECONDS + $(node_loss_wait)))", "deadline=0", [NODE_DROPPED_LATE]),
    "a controller that fails once is taken at its word": (
        "hpc/resumable.sh", "for ((try = 1; try <= SCONTROL_TRIES; try++)); do",
        "for ((try = SCONTROL_TRIES; try <= SCONTROL_TRIES; try++)); do", [CONTROLLER_FAILS]),
    "dropout keyed by the row of the batch, not the sample": (
        "fsdp_mpi/loop/sample_dropout.py", "_combine(run, torch.as_tensor(samples, dtype=torch.int64).flatten())",
        "_combine(run, torch.arange(len(samples)))", [SPLIT_DROPOUT]),
}

# Mutants of going on after a lost rank: killed by tests that need Open MPI's ULFM (marked open_mpi), so run in
# the pass that has it (CI's Open MPI pass), where the other mutants are not run again.
PROTOCOL = ("tests/test_elastic.py::"
            "test_every_survivor_ends_the_step_in_one_agreement_and_a_real_error_after_a_loss_stays_an_error")
USERS_LOOP = ("tests/test_elastic.py::"
              "test_a_users_loop_survives_losses_as_it_starts_in_the_found_inf_reduction_a_save_and_a_recovery")
HYBRID_ELASTIC = ("tests/test_elastic.py::"
                  "test_hybrid_shard_goes_on_from_memory_then_from_a_checkpoint_when_no_group_is_left_whole")
GROW_BACK = "tests/test_elastic.py::test_hybrid_shard_grows_back_after_each_loss_every_newcomer_healed_by_its_twin"
GROW_INTO_ADDED_HOSTS = ("tests/test_elastic.py::"
                         "test_a_node_lost_whole_with_no_free_slot_goes_on_shrunk_and_grows_back_once_a_host_is_added")
LIGHTNING_ELASTIC = ("tests/test_lightning.py::"
                     "test_fit_elastic_goes_on_shrunk_after_a_lost_node_and_grows_back_into_an_added_host[FULL_SHARD]")
LIGHTNING_REFUSED_GROWTH = ("tests/test_lightning.py::"
                            "test_fit_elastic_goes_on_after_a_loss_while_it_rebuilds_and_after_a_growth_that_cannot_start")
ULFM_MUTANTS = {
    "after a growth that cannot start, a Trainer interrupted in its fit is fitted again as it was": (
        "fsdp_mpi/elastic/recovery.py", "as_it_was = run if plan.held is not None else _rebuild(run, survivors, False, plan, {})",
        "as_it_was = run", [LIGHTNING_REFUSED_GROWTH]),
    "a Trainer under fit_elastic skips the step's agreement, so it never grows back into added hosts": (
        "fsdp_mpi/lightning.py", "self.precision_plugin.step_agreement = (lambda: end_step(self.comm)) if",
        "self.precision_plugin.step_agreement = None if", [LIGHTNING_ELASTIC]),
    "a newcomer trains from its own fresh build, its twin's state received and dropped": (
        "fsdp_mpi/elastic/recovery.py", "                plan.take(rebuilt, going_on.receive_object(twin))",
        "                going_on.receive_object(twin)", [GROW_BACK]),
    "a survivor whose step completed goes on without the step's agreement": (
        "fsdp_mpi/elastic/agreement.py", "    if interrupted is None and not can_go_on():",
        "    if interrupted is None:", [PROTOCOL]),
    "a shard group that lost a rank goes on from memory beside the whole ones": (
        "fsdp_mpi/elastic/recovery.py", "            if from_memory and not whole[survivors.rank]:",
        "            if False:", [HYBRID_ELASTIC]),
    "an error after a lost rank is left to MPI_Abort, whose launcher may then hang or report success": (
        "fsdp_mpi/communication/failures/abort.py", "    if _the_job_lost_a_rank():", "    if False:", [PROTOCOL]),
    "the old run lives on after a recovery until Python's next full collection": (
        "fsdp_mpi/elastic/runner.py", "        collect_the_old_run()\n", "", [HYBRID_ELASTIC]),
    "a revoked communicator keeps its node memory for as long as the loop keeps it": (
        "fsdp_mpi/communication/comm.py", "        self._routes.transports.clear()\n", "", [HYBRID_ELASTIC]),
    "a rank that finds hosts added does not say so in the step's agreement, so the run never grows back": (
        "fsdp_mpi/elastic/agreement.py", "(0 if grow else STAY)", "STAY", [GROW_INTO_ADDED_HOSTS]),
    "a rank lost during a recovery ends it instead of starting it again on fewer ranks": (
        "fsdp_mpi/elastic/recovery.py", "            continue  # shrink `failing` again, from the same committed state",
        "            raise", [USERS_LOOP]),
}


def copy_of_repository(destination: Path) -> Path:
    ignored = shutil.ignore_patterns(".git", ".venv*", ".gpu*", "results", "runs", "__pycache__", "*.egg-info", ".pytest_cache")
    shutil.copytree(REPO, destination, ignore=ignored)
    # The installed project maps fsdp_mpi_models to the checkout's models/ (setup.cfg): in the copy that name
    # must reach the copy's models/, or a mutant there would go untested. The copy's root comes first on sys.path.
    (destination / "fsdp_mpi_models").symlink_to("models", target_is_directory=True)
    return destination


@pytest.fixture(scope="module")
def pytest_runs():
    """Where the mutants' pytest runs start: forked from one process that imported torch once (harness/warm_pytest.py)."""
    runs = WarmPytest()
    yield runs
    runs.close()


def run_tests(runs: WarmPytest, tests: list[str], cwd: Path,
              verdict: Path | None = None) -> subprocess.CompletedProcess:
    plugin = ["-p", "mutation_verdict"] if verdict else []
    path = os.pathsep.join(filter(None, [str(cwd / "tests" / "harness"), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path, **({VERDICT_ENV: str(verdict)} if verdict else {}))
    return runs.run(["-q", "-p", "no:cacheprovider", *plugin, *tests], cwd=cwd, env=env, timeout=900)


_unmutated: dict[str, str] = {}  # a named test (or file) -> how it ended unmutated, where this session had not run it


def _named(spec: str, node: str) -> bool:
    return node == spec or node.startswith((f"{spec}::", f"{spec}["))


def unmutated_outcomes(runs: WarmPytest, tests: list[str], outcomes_so_far: dict[str, str],
                       elsewhere: set[str]) -> dict[str, str]:
    """How each named test ended on the code as it is: from this process (the mutants run last, see
    conftest.py); under pytest-xdist, "this session" for a test another worker runs, whose failure fails the
    session; else from one run of those tests here."""
    found = {}
    for spec in tests:
        ran = {node: outcome for node, outcome in outcomes_so_far.items() if _named(spec, node)}
        if not ran and any(_named(spec, node) for node in elsewhere):
            ran = {spec: "in this session"}
        if not ran:
            if spec not in _unmutated:
                result = run_tests(runs, [spec], REPO)
                skipped = re.search(r"\b\d+ skipped\b", result.stdout)  # pytest's summary line; exit 0 all the same
                _unmutated[spec] = "failed" if result.returncode else "skipped" if skipped else "passed"
            ran = {spec: _unmutated[spec]}
        found.update(ran)
    return found


# The mutants test the suite, not the MPI library (one_mpi), but for ULFM's, which need Open MPI (open_mpi).
@pytest.mark.parametrize("name", [*(pytest.param(name, marks=pytest.mark.one_mpi) for name in MUTANTS),
                                  *(pytest.param(name, marks=pytest.mark.open_mpi) for name in ULFM_MUTANTS)])
def test_mutant_is_killed(name, tmp_path, outcomes_so_far, run_elsewhere_in_this_session, pytest_runs):
    path, original, mutated, tests = {**MUTANTS, **ULFM_MUTANTS}[name]
    unmutated = unmutated_outcomes(pytest_runs, tests, outcomes_so_far, run_elsewhere_in_this_session)
    if "skipped" in unmutated.values() and "failed" not in unmutated.values():
        pytest.skip(f"the tests that would kill it skip on this machine: {unmutated}")
    assert set(unmutated.values()) <= {"passed", "in this session"}, f"the named tests do not pass unmutated: {unmutated}"
    repo = copy_of_repository(tmp_path / "repo")
    source = repo / path
    text = source.read_text()
    assert text.count(original) == 1, f"the mutant's line is not (once) in {path}: update the mutant"
    source.write_text(text.replace(original, mutated))
    verdict = tmp_path / "verdict"
    result = run_tests(pytest_runs, tests, repo, verdict)
    for left in Path("/dev/shm").glob("fsdp_mpi-*"):  # what a mutant leaked: its maker (rank 0) has ended
        if not Path(f"/proc/{left.name.split('-')[1]}").exists():  # not a job's running beside this one
            left.unlink(missing_ok=True)
    summary = result.stdout.strip().splitlines()[-1:] or [""]
    if not verdict.exists() and " skipped" in summary[0] and not re.search(r"\b(passed|failed|error)", summary[0]):
        pytest.skip(f"the tests that would kill it skip on this machine: {summary[0]}")  # another worker ran them
    assert verdict.exists(), (f"mutant survived: no check failed (exit {result.returncode}; an error, a crash or a "
                              f"timeout is not a kill):\n{result.stdout[-3000:]}")

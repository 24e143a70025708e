"""The suite's two tiers. `make test` (CI, a 2-core machine, under 25 minutes) runs the tests not
marked `slow`; `make test-all` runs every test. A test is slow-tier when the property it checks is
also checked in the CI tier on a cheaper member of the same sweep, or when it is the CPU dry run of a
GPU experiment script or a long end-to-end run of a user tool; each entry says which CI-tier test
covers it or what it alone runs. Keys: a test file, `file::test` (every parametrization) or
`file::test[id]`. conftest.py marks the collected tests (`pytest -m slow` runs only these).
"""

from __future__ import annotations

SLOW: dict[str, str] = {
  # the GPU experiment scripts' CPU dry runs: the modules they drive are tested on their own
  "test_sharded_round_cost.py": "experiments/sharded_round_cost.py's dry run",
  "test_serve_round_cost.py": "experiments/serve_round_cost.py's dry run",
  "test_serve_call_cost.py": "experiments/serve_call_cost.py's dry run",
  "test_decode_flags.py::test_tiny_dry_run_writes_kernels_and_timings": "experiments/decode_flags dry run",
  "test_engine.py::test_early_exit_blocks_draft_what_the_unrolled_drafter_drafts[1]": "CI: [2] (blocks after an unrolled step)",
  "test_decode_flags.py::test_in_out_products_change_no_value": "an experiment variant of decode_flags",
  "test_decode_flags.py::test_scatter_cache_write_changes_no_value": "an experiment variant of decode_flags",
  "test_decode_flags.py::test_norm_after_projection_changes_values_by_rounding_only": "an experiment variant of decode_flags",
  "test_decode_flags.py::test_single_pass_decode_attention_keeps_the_tokens": "an experiment variant of decode_flags; CI: the kernel's single pass in test_verify_attention",
  "test_decode_flags.py::test_two_row_products_change_no_value": "CI: test_models::test_row_product_two_rows_for_wide_matrices_same_values",
  # sweeps whose every property a CI-tier test checks on a cheaper member
  "test_sharding.py::test_every_speculator_is_lossless_on_a_data_and_model_mesh": "registry on a mesh; CI: greedy on a mesh, sampled law on a mesh, every speculator on one device",
  "test_sharding.py::test_two_processes_give_the_one_process_tokens": "two jax.distributed processes",
  "test_sharding.py::test_greedy_output_is_the_one_device_output_on_every_mesh[3]": "batch 3 padded over (2, 4); CI: batch 1 on (2, 4)",
  "test_sharding.py::test_smollm2_shards_over_model_2_padded_with_the_one_device_tokens": "CI: padded kv heads on the tiny target",
  "test_sharding.py::test_heads_split_over_the_model_axis_keep_the_one_device_output": "head placement on a mesh",
  "test_partition_layout.py": "model-axis layout of every arch; CI: sharding tests",
  "test_hybrid.py::test_api_and_cli_take_the_rollback_mode": "API / CLI plumbing of the rollback switch",
  "test_hybrid.py::test_greedy_speculation_is_lossless[redecode-draft-1]": "CI: the other rollback / drafter pairs",
  "test_adaptive_tree.py::test_greedy_is_lossless_and_budgets_follow_acceptance[draft_tree]": "CI: [dflash_tree]",
  "test_adaptive_tree.py::test_warm_run_times_every_budget_per_drafter": "CI: test_adaptive's warm run",
  "test_adaptive.py::test_warm_run_replaces_the_calibration_by_timed_rounds": "CI: the warm run compiles every width",
  "test_adaptive.py::test_host_loop_warm_up_compiles_the_plain_segment": "CI: the device loop's warm run compiles every width",
  "test_adaptive.py::test_adaptive_greedy_is_lossless[flat]": "CI: [backs_off]",
  "test_adaptive.py::test_adaptive_greedy_is_lossless[mild]": "CI: [backs_off]",
  "test_serve_adaptive.py::test_adaptive_drops_a_drafter_that_never_lands": "CI: test_adaptive_lossless_and_fields_stay_per_request",
  "test_head_eval.py::test_eval_eagle3_chains_and_tree_through_the_harness": "the eval harness on EAGLE-3 chains and trees",
  "test_builtin_mtp.py::test_speculative_greedy_equals_plain_greedy[redecode]": "CI: [per_step]",
  "test_eagle3.py::test_speculation_is_lossless_batch_3_and_sampled[chain]": "CI: test_registry_laws[eagle3]",
  "test_tree.py::test_greedy_tree_speculation_is_lossless[batch1]": "CI: [batch3_ragged]",
  "test_compact_path.py::test_tree_speculation_through_the_kernel_is_lossless": "an opt-in kernel; CI: kernel = reference on random paths",
  "test_dflash_reference.py::test_a_reference_folder_loads_drafts_as_zlab_and_losslessly": "CI: export then reference load",
  "test_eagle3_reference.py::test_a_reference_folder_loads_and_drafts_losslessly": "CI: export then reference load",
  "test_mtp_reference.py::test_a_reference_folder_loads_and_drafts_losslessly": "CI: export then reference load",
  "test_dflash_train.py::test_warm_start_into_a_deeper_drafter_computes_the_same_blocks": "warm start into a deeper drafter",
  # end to end runs of user tools, each long
  "test_notebooks.py::test_notebook_runs[training_a_small_head]": "CI: the committed-executed checks; training in test_train*",
  "test_bench_resume.py": "killed bench runs resume",
  "test_bench.py::test_tiny_run_numbers_match_the_engine": "CI: the adaptive bench run",
  "test_speculator_registry.py::test_plugin_is_lossless_and_drafts_from_its_corpus": "CI: the plugin in test_registry_laws",
  "test_data_magpie.py::test_sampled_queries_close_the_user_turn_and_repeat_for_a_seed": "Magpie sampling",
  "test_user_errors.py::test_unwritable_compile_cache_runs_uncached": "an unwritable cache folder",
  "test_serve_prefill.py::test_warm_up_compiles_every_program_ahead": "CI: test_no_compilation_after_warm_up",
  "test_serve_prefill.py::test_requests_arriving_together_prefill_in_one_call[mtp]": "CI: [None]",
  "test_serve_prefill.py::test_one_pass_prompt_near_a_capacity_off_the_64_grid": "a prompt near the capacity",
  "test_serve.py::test_cancel_within_one_call": "CI: cancel in test_load_cancel_malformed_then_healthy",
  "test_hybrid.py::test_adaptive_drafting_on_the_hybrid_target_is_lossless": "CI: hybrid rollback, adaptive on attention targets",
  "test_dflash_train.py::test_eval_rows_equal_plain_decoding_and_are_saved_row_by_row": "dflash eval rows",
  "test_dflash_train.py::test_held_out_scoring_equals_the_loss_metrics": "dflash held-out scoring",
  "test_chat_data.py::test_regenerated_turns_are_the_targets_greedy_answers": "regenerated chat data",
  "test_user_errors.py::test_context_checks_on_the_command_line": "CI: the API's context checks",
  "test_batch_invariant.py::test_decoder_logits_decode_equal_chain_and_tree_verification[gemma3-f32]": "CI: [llama-bf16]",
  "test_sharding.py::test_a_training_step_on_a_mesh_is_the_one_device_step": "training on a mesh",
  "test_registry_laws.py::test_tree_node_budget_is_its_option_and_n_max_its_depth[eagle3_tree]": "CI: [dflash_tree]",
  "test_registry_laws.py::test_tree_node_budget_is_its_option_and_n_max_its_depth[draft_tree]": "CI: [dflash_tree]",
  "test_data_magpie.py::test_dataset_with_magpie_source_resumes_to_identical_shards": "Magpie shards resume",
  "test_kvcache.py::test_ragged_batch_greedy_decodes_like_alone[tiny_gemma]": "CI: [tiny_llama]",
  "test_dflash_tree.py::test_greedy_rounds_replay_from_training_blocks": "CI: EAGLE-3's engine acceptance = its training-time test",
  "test_dflash_tree.py::test_sampling_keeps_the_token_law": "CI: every speculator's sampled law in test_registry_laws",
  "test_dflash_tree.py::test_greedy_is_lossless_batch_1": "CI: test_registry_laws[dflash_tree]",
  "test_dflash.py::test_sampling_keeps_the_token_law": "CI: every speculator's sampled law in test_registry_laws",
  "test_serve_adaptive.py::test_adaptive_tree_lossless_and_drops_a_tree_that_never_lands": "CI: adaptive serving per request; tree budgets in test_adaptive_tree",
  "test_head_eval.py::test_eval_mtp_rows_through_the_harness": "the eval harness on MTP rows",
  "test_ngram_mod_device.py": "CI: test_registry_laws[ngram_mod]",
  "test_tune.py::test_halving_run_picks_the_best_measured_trial": "a tuner run end to end",
  "test_adaptive_tree.py::test_greedy_is_lossless_and_budgets_follow_acceptance[eagle3_tree]": "CI: [dflash_tree]",
  "test_adaptive_tree.py::test_eagle3_tree_budgets_are_its_best_ranked_nodes": "CI: smaller budgets are a wider tree's best-ranked nodes",
  "test_sharding.py::test_kv_heads_the_model_axis_does_not_divide_are_padded_and_give_the_one_device_tokens": "CI: test_padding_kv_groups_keeps_the_forward",
  "test_user_errors.py::test_forged_assistant_turn_via_the_cli_is_text": "the CLI path of a forged assistant turn",
  "test_mtp.py::test_speculation_with_mtp_is_lossless": "CI: test_registry_laws[mtp]",
  "test_eagle3.py::test_greedy_speculation_is_lossless_batch_1[chain]": "CI: test_registry_laws[eagle3]",
  "test_batch_invariant.py::test_speculative_greedy_equals_plain_greedy_in_bf16": "CI: decode = chain = tree logits in [llama-bf16]; on the GPU, experiments/invariant_equality.py for every speculator",
  "test_serve.py::test_buckets_and_multi_round_calls_stay_lossless[ngram_host-together-None]": "CI: mtp and plain",
  "test_serve.py::test_buckets_and_multi_round_calls_stay_lossless[ngram_simple-reversed-None]": "CI: mtp and plain",
  "test_serve.py::test_buckets_and_multi_round_calls_stay_lossless[None-together-None]": "CI: [mtp-shuffled-None]; plain serving in test_concurrent_streams_equal_offline_greedy",
  "test_adaptive_tree.py::test_sampling_keeps_the_token_law": "CI: the adaptive controller's sampled law (test_adaptive), tree sampling's law (test_tree), dflash_tree's in test_registry_laws",
  "test_accept_sample.py::test_engine_sampling_identical_through_kernel": "CI: the kernel = the reference on random rounds (test_accept_sample)",
  "test_eagle3.py::test_speculation_is_lossless_batch_3_and_sampled[tree]": "CI: test_registry_laws[eagle3_tree]; the engine's acceptance = the training-time test",
  "test_ngram.py::test_greedy_lossless_through_engine": "CI: test_registry_laws (every n-gram speculator's greedy output and sampled law)",
  "test_plain_chunks.py::test_plain_chunks_leave_the_state_of_width_zero_rounds[draft_tree]": "CI: the other drafters (draft_tree's commit is a no-op; its propose catches up)",
  "test_plain_chunks.py::test_plain_chunks_leave_the_state_of_width_zero_rounds[eagle3]": "CI: [eagle3_tree] (the same commit; the chain's begin_chunk adds only the sampler key step)",
  "test_plain_chunks.py::test_plain_chunks_leave_the_state_of_width_zero_rounds[dflash]": "CI: [dflash_tree] (the same commit and begin_chunk)",
  "test_plain_chunks.py::test_adaptive_chains_back_off_to_plain_chunks_losslessly[eagle3]": "CI: [mtp]; the chunks' state in test_plain_chunks_leave_the_state_of_width_zero_rounds[eagle3_tree]",
  "test_plain_chunks.py::test_adaptive_chains_back_off_to_plain_chunks_losslessly[dflash]": "CI: [mtp]; the chunks' state in test_plain_chunks_leave_the_state_of_width_zero_rounds[dflash_tree]",
  "test_engine.py::test_sampled_speculation_preserves_the_token_law[temp1]": "CI: [temp1_topk5_topp0.9] (the same drafter and law check, filtered), test_registry_laws[draft]",
  "test_sharding.py::test_sampled_speculation_on_a_mesh_keeps_the_token_law": "CI: greedy on a (2, 4) mesh (the sampler's keys are per sequence and the mesh splits sequences); the law on one device in test_engine and test_registry_laws",
  "test_plain_chunks.py::test_plain_chunks_leave_the_state_of_width_zero_rounds[mtp]": "CI: [eagle3_tree] (MTP's commit writes the same kind of entries); MTP's begin_chunk and chunks in test_server_rounds_at_width_zero_leave_the_state_of_width_zero_rounds, its back-off in test_adaptive_chains_back_off_to_plain_chunks_losslessly[mtp]",
  "test_dflash.py::test_greedy_is_lossless_batch_1_and_3": "CI: test_registry_laws[dflash] (lossless), test_engine_rounds_replay_from_training_blocks (a trained drafter's rounds in the engine)",
  "test_eagle3.py::test_greedy_speculation_is_lossless_batch_1[tree]": "CI: test_registry_laws[eagle3_tree]",
  "test_fused_decode.py::test_kernels_over_row_blocks_and_ragged_columns[dot-unrolled]": "CI: [dot-one-step], [dot-row-blocks]",
  "test_fused_decode.py::test_kernels_over_row_blocks_and_ragged_columns[row-sums-unrolled]": "CI: [row-sums-loop]",
  "test_fused_decode.py::test_kernels_over_row_blocks_and_ragged_columns[row-sums-one-step]": "CI: [row-sums-loop]",
  "test_fused_decode.py::test_greedy_decode_tokens_equal_the_xla_path[qwen3-qknorm]": "CI: [llama]; qk-norm in test_fused_block_equals_xla_block[qwen3-qknorm-float32-decode]",
  "test_hybrid.py::test_greedy_speculation_is_lossless[per_step-ngram_simple-1]": "CI: [redecode-ngram_simple-3], [per_step-draft-3]",
  "test_engine.py::test_p_min_and_n_max_cut_the_draft[blocks-of-1]": "CI: [blocks-of-2]",
}

# The opt-in fused decode layers (slower than XLA where measured): each architecture once in the CI tier,
# float32 / bfloat16 and decode / 5-token verification each on some architecture.
_FUSED_CI = {"llama-bfloat16-decode", "llama-float32-verify5", "qwen2-bias-bfloat16-verify5",
             "qwen3-qknorm-float32-decode", "llama-obias-mha-bfloat16-decode", "mistral-sliding-float32-verify5"}
SLOW.update({f"test_fused_decode.py::test_fused_block_equals_xla_block[{a}-{d}-{m}]":
             "CI: the same architecture in another dtype / step shape (_FUSED_CI)"
             for a in ("llama", "qwen2-bias", "qwen3-qknorm", "llama-obias-mha", "mistral-sliding")
             for d in ("float32", "bfloat16") for m in ("decode", "verify5") if f"{a}-{d}-{m}" not in _FUSED_CI})


def slow_reason(nodeid: str) -> str | None:
  """Why the test `nodeid` ("tests/file.py::test[id]") is in the slow tier, or None (CI tier)."""
  path, _, name = nodeid.partition("::")
  file = path.rsplit("/", 1)[-1]
  for key in (f"{file}::{name}", f"{file}::{name.split('[')[0]}", file):
    if key in SLOW:
      return SLOW[key]
  return None

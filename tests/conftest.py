import os

# Simulated devices must be configured before JAX initializes its backend.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import pytest  # noqa: E402

# The default `make test` (two pytest workers) must stay near 15 minutes on 2 cores; these run under
# `make test-all` (`-m ''`). Each is the longest of its feature's tests (seconds
# measured on 2 busy cores), and its feature keeps a quicker test in the default run.
SLOW = {
    "test_remat_unrolled.py::test_auto_remat_recomputes_only_the_layers_the_budget_needs": 56,
    "test_planning_time.py::test_a_long_search_shows_progress_on_stderr": 195,
    "test_planning_time.py::test_cache_hit_in_a_fresh_process_is_fast": 41,
    "test_pipeline.py::test_1f1b_holds_fewer_activations_than_gpipe": 164,
    "test_pipeline.py::test_pipelined_training_matches_single_device[gpipe]": 101,
    "test_pipeline.py::test_compiled_pipeline_moves_activations_with_collective_permute": 96,
    "test_pipeline.py::test_options_combine[mesh0-options0]": 93,
    "test_pipeline.py::test_microbatch_count_is_chosen_by_the_cost_model": 76,
    "test_pipeline.py::test_step_floor_is_under_every_try_and_skips_what_cannot_win": 45,
    "test_pipeline.py::test_auto_stage_count_keeps_the_fastest_plan": 45,
    "test_pipeline.py::test_plan_file_round_trips_and_replays": 44,
    "test_pipeline.py::test_a_stack_of_as_many_layers_as_examples_is_not_cut_as_a_batch": 35,
    "test_partial.py::test_random_plans_of_a_gpt_train_step_are_exact[0]": 109,
    "test_remat.py::test_remat_auto_picks_a_policy_that_fits": 84,
    "test_precision.py::test_parallelize_trains_in_low_precision_and_records_it[fp16-dtype1-0.0001]": 71,
    "test_numerics.py::test_sharded_equals_single_device[gpt_scan-data2xmodel4-auto]": 67,
    "test_numerics.py::test_sharded_equals_single_device[gpt-data4xmodel2-auto]": 42,
    "test_numerics.py::test_memory_budget_forces_sharding": 33,
    "test_accumulate.py::test_accumulation_cuts_compiled_memory": 51,
    "test_cli.py::test_search_with_pipeline_remat_and_precision": 45,
    "test_scan.py::test_scan_plan_file_round_trips_and_runs": 38,
    "test_layers.py::test_dp_engine_uses_the_reduction_and_lowers_correctly": 35,
    "test_search.py::test_over_budget_tries_zero_stages_and_keeps_the_fastest_that_fits": 34,
    "test_suite_models.py::test_trains_under_jit_and_autopar_matches[vit]": 32,
    "test_suite_models.py::test_trains_under_jit_and_autopar_matches[wide_resnet]": 30,
    "test_optimality.py::test_dp_and_recursive_near_the_ilp_optimum_at_suite_widths": 30,
    "test_messages.py::test_offline_plan_close_to_the_budget_warns": 27,
    "test_cli_render_calibrate.py::test_calibrate_writes_a_loadable_profile_that_search_uses": 24,
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.nodeid.split("/")[-1] in SLOW:
            item.add_marker(pytest.mark.slow)

"""ThroughputMonitor on the TensorFlow backend: the shared bodies of
callbacks/_throughput_cases.py, collected by this backend's job."""

from callbacks._throughput_cases import (  # noqa: F401
    test_an_accumulation_window_is_one_update,
    test_bad_arguments_are_refused_at_construction,
    test_bytes_per_update_and_predicted_scaling_at_n_devices,
    test_compile_time_is_reported_once_and_a_second_fit_compiles_nothing,
    test_config_round_trips_through_keras_serialization,
    test_figures_are_global_under_a_strategy,
    test_fit_keeps_keras_asynchronous_dispatch,
    test_gpt2_backbone_flops_and_tokens_per_sec,
    test_keys_reach_history_and_csv_with_flops_of_the_analytic_count,
    test_mfu_and_hfu_against_a_given_peak,
    test_peaks_table_by_device_kind_and_dtype,
    test_samples_per_sec_is_the_wall_clock_rate_of_its_window,
    test_the_per_batch_hook_reads_no_log_value,
)

"""Keras 3 (TensorFlow): a recomputed tf.function step saves memory in any
order TensorFlow's executor runs the ready ops (one inter-op thread here;
a loaded machine also reorders them). The tf_keras twin, and why, is in
tests/legacy/test_recompute_in_place.py."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_tf_function_saves_memory_in_any_executor_order():
    from _processes import run_in_process

    peaks = run_in_process(
        "legacy.recompute_order_bodies:one_thread_peaks",
        timeout=240,
        env={"TF_ENABLE_ONEDNN_OPTS": "1", "TF_USE_LEGACY_KERAS": "0"},
    )
    assert peaks["plain"] > 10, peaks  # statistics are live
    # Measured, one inter-op thread: 8.75 of 40.25 MiB (0.22); 26.75
    # (0.66) before the block's input gradients waited for its weight
    # gradients.
    assert peaks["recompute"] / peaks["plain"] <= 0.5, peaks

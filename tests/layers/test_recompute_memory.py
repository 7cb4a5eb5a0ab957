"""Recompute saves memory in every mode a training step runs in: an eager
custom loop (`GradientTape` outside `tf.function`), the same step under
`tf.function`, and `fit(run_eagerly=True)`.

Allocator peaks need oneDNN on (keras-facts.md), so they are measured in a
process of their own with `TF_ENABLE_ONEDNN_OPTS=1` set explicitly (this
CPU's default is not every CPU's). tf_keras: tests/legacy/
test_recompute_in_place.py runs the same body. Gradients in those modes:
test_recompute_in_place.py.
"""

from __future__ import annotations

import pytest
from _processes import run_in_process
from layers.memory_bodies import (
    assert_recompute_keeps_only_its_floor,
    assert_recompute_saves_memory,
)


@pytest.mark.slow
def test_peak_memory_eager_tf_function_and_fit_run_eagerly():
    peaks = run_in_process(
        "layers.memory_bodies:step_peaks",
        timeout=240,
        env={"TF_ENABLE_ONEDNN_OPTS": "1", "TF_USE_LEGACY_KERAS": "0"},
    )
    assert set(peaks) == {"eager", "tf_function", "fit_run_eagerly"}
    assert_recompute_saves_memory(peaks)


@pytest.mark.slow
def test_recompute_keeps_only_what_its_plan_stores():
    """On a deep MLP (8 blocks of 4 Dense 256, batch 2048: one activation
    = 2 MiB) each recomputed step's peak is at most the activations its plan
    keeps (per block 12, min_memory on the blocks 10, on the 32 layers 9;
    plain 33) and one layer's backward buffers: the engine holds nothing
    beyond the boundaries and the segment being recomputed (issue 19 item 8;
    `bench_recompute.py --deep` prints the same floors at full size).
    Keeping one block more (block_0 not recomputed) fails it."""
    peaks = run_in_process(
        "layers.memory_bodies:deep_mlp_peaks",
        timeout=240,
        env={"TF_ENABLE_ONEDNN_OPTS": "1", "TF_USE_LEGACY_KERAS": "0"},
    )
    assert_recompute_keeps_only_its_floor(peaks)

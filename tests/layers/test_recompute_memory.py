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
from layers.memory_bodies import assert_recompute_saves_memory


@pytest.mark.slow
def test_peak_memory_eager_tf_function_and_fit_run_eagerly():
    peaks = run_in_process(
        "layers.memory_bodies:step_peaks",
        timeout=240,
        env={"TF_ENABLE_ONEDNN_OPTS": "1", "TF_USE_LEGACY_KERAS": "0"},
    )
    assert set(peaks) == {"eager", "tf_function", "fit_run_eagerly"}
    assert_recompute_saves_memory(peaks)

"""An accumulation window inside one `steps_per_execution` call on
TensorFlow: Keras 3.15 runs the `steps_per_execution` micro-steps as a
`tf.while_loop` in one `tf.function` call, so a window of K micro-steps is
one device call (bodies shared with JAX: `execution_bodies.py`)."""

from __future__ import annotations

import pytest
from execution_bodies import (
    ACCUMULATION,
    UPDATES,
    accumulated,
    check_equals_the_large_batch,
    plain_large_batch,
)


@pytest.mark.parametrize(
    "windows_per_call", (pytest.param(1, marks=pytest.mark.slow), 2)
)
def test_windows_in_one_call_equal_the_large_batch(windows_per_call):
    steps = windows_per_call * ACCUMULATION
    weights, calls = accumulated(steps)
    check_equals_the_large_batch(weights, plain_large_batch())
    # One `tf.function` call per `steps_per_execution` micro-steps.
    assert calls == UPDATES * ACCUMULATION // steps

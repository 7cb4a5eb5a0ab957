"""An accumulation window inside one `steps_per_execution` call on JAX
(bodies shared with TensorFlow: `execution_bodies.py`).

Keras 3.15's JAX trainer runs `steps_per_execution` as a Python loop over
its jitted train step: one `train_function` call per execution, but one
jitted (device) call per micro-step, whatever the optimizer. Keras 3.16
runs the loop as one `lax.scan` (keras#23527): the window is then one
device call without a change here.
"""

from __future__ import annotations

import keras
import pytest
from execution_bodies import (
    ACCUMULATION,
    UPDATES,
    accumulated,
    check_equals_the_large_batch,
    plain_large_batch,
)
from keras.src.backend.jax import trainer as jax_trainer


@pytest.fixture
def jitted_calls(monkeypatch):
    """Counts calls of the functions Keras's JAX trainer jits."""
    calls = []
    jit = jax_trainer.jit

    def counting_jit(function, *args, **kwargs):
        compiled = jit(function, *args, **kwargs)

        def counted(*a, **k):
            calls.append(function)
            return compiled(*a, **k)

        return counted

    monkeypatch.setattr(jax_trainer, "jit", counting_jit)
    return calls


@pytest.mark.parametrize(
    "windows_per_call", (pytest.param(1, marks=pytest.mark.slow), 2)
)
def test_windows_in_one_execution_equal_the_large_batch(
    windows_per_call, jitted_calls
):
    steps = windows_per_call * ACCUMULATION
    weights, calls = accumulated(steps)
    check_equals_the_large_batch(weights, plain_large_batch())
    assert calls == UPDATES * ACCUMULATION // steps


@pytest.mark.keras_limit
def test_keras_3_15_dispatches_each_micro_step(jitted_calls):
    """Keras 3.15: one jitted call per micro-step under steps_per_execution
    (fails once Keras runs the steps as one compiled loop: then the window
    is one device call, and the docs should say so)."""
    if tuple(int(p) for p in keras.version().split(".")[:2]) >= (3, 16):
        pytest.skip("Keras >= 3.16 loops inside one compiled call")
    accumulated(2 * ACCUMULATION)
    micro_steps = UPDATES * ACCUMULATION
    train_steps = [f for f in jitted_calls if f.__name__ == "train_step"]
    assert len(train_steps) == micro_steps

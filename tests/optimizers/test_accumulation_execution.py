"""An accumulation window inside one `steps_per_execution` call (issue 36
item 3), on each backend.

With `steps_per_execution = n·K`, Keras runs `n` windows per call of its
`train_function`; the run must equal the plain optimizer on the large batch.
How many device calls one execution makes is the backend's: TensorFlow
(Keras 3.15) runs the micro-steps as a `tf.while_loop` in one `tf.function`
call, so a window of K micro-steps is one device call; Keras 3.15's JAX
trainer loops in Python over its jitted train step, one jitted (device) call
per micro-step, whatever the optimizer. Keras 3.16 runs the JAX loop as one
`lax.scan` (keras#23527): the window is then one device call without a
change here.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
from _training import assert_weights_close, mlp, regression_data

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras

pytestmark = pytest.mark.backends("tensorflow", "jax")

ACCUMULATION = 2
BATCH = 4
UPDATES = 4
SAMPLES = UPDATES * ACCUMULATION * BATCH


def _inner():
    return keras.optimizers.Adam(0.01)


@functools.cache
def _plain_large_batch() -> list:
    x, y = regression_data(SAMPLES)
    model = mlp()
    model.compile(optimizer=_inner(), loss="mse")
    model.fit(x, y, batch_size=ACCUMULATION * BATCH, shuffle=False, verbose=0)
    return model.get_weights()


def _accumulated(steps_per_execution: int) -> tuple:
    """(weights, calls of `model.train_function`) of one epoch of
    `UPDATES` windows with `steps_per_execution` micro-steps per call."""
    x, y = regression_data(SAMPLES)
    model = mlp()
    model.compile(
        optimizer=GradientAccumulationOptimizer(_inner(), ACCUMULATION),
        loss="mse",
        steps_per_execution=steps_per_execution,
    )
    model.make_train_function()
    calls = []
    function = model.train_function

    def counted(*args, **kwargs):
        calls.append(1)
        return function(*args, **kwargs)

    model.train_function = counted
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    return model.get_weights(), len(calls)


@pytest.fixture
def jitted_calls(monkeypatch):
    """Counts calls of the functions Keras's JAX trainer jits."""
    from keras.src.backend.jax import trainer as jax_trainer

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
def test_windows_in_one_execution_equal_the_large_batch(windows_per_call):
    steps = windows_per_call * ACCUMULATION
    weights, calls = _accumulated(steps)
    assert_weights_close(weights, _plain_large_batch(), rtol=1e-5, atol=2e-6)
    assert not all(np.allclose(w, 0) for w in weights)
    # One `train_function` call per `steps_per_execution` micro-steps.
    assert calls == UPDATES * ACCUMULATION // steps


@pytest.mark.backends("jax")
@pytest.mark.keras_limit
def test_keras_3_15_dispatches_each_micro_step(jitted_calls):
    """Keras 3.15 on JAX: one jitted call per micro-step under
    steps_per_execution (fails once Keras runs the steps as one compiled
    loop: then the window is one device call, and the docs should say so)."""
    if tuple(int(p) for p in keras.version().split(".")[:2]) >= (3, 16):
        pytest.skip("Keras >= 3.16 loops inside one compiled call")
    _accumulated(2 * ACCUMULATION)
    micro_steps = UPDATES * ACCUMULATION
    train_steps = [f for f in jitted_calls if f.__name__ == "train_step"]
    assert len(train_steps) == micro_steps


@pytest.mark.backends("tensorflow")
def test_per_update_reduction_is_accepted_on_tensorflow():
    """`reduction="per_update"` (JAX's once-per-window reduction) is what
    tf.distribute already does: accepted, kept in the config; a value
    outside the two is refused at construction on either backend."""
    optimizer = GradientAccumulationOptimizer(
        _inner(), ACCUMULATION, reduction="per_update"
    )
    assert optimizer.get_config()["reduction"] == "per_update"
    assert not optimizer._per_device_accumulation
    with pytest.raises(ValueError, match="reduction='once'"):
        GradientAccumulationOptimizer(_inner(), 2, reduction="once")

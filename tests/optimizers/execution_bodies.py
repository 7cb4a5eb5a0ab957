"""An accumulation window inside one `steps_per_execution` call (issue 36
item 3), one body for both backends (`test_accumulation_execution.py`,
`test_accumulation_execution_jax.py`).

With `steps_per_execution = n·K`, Keras runs `n` windows per call of its
`train_function`; the run must equal the plain optimizer on the large batch.
How many device calls one execution makes is the backend's: the test
modules count them (one `tf.function` call on TensorFlow; on JAX, Keras 3.15
loops in Python over one jitted call per micro-step).
"""

from __future__ import annotations

import functools

import numpy as np
from _training import assert_weights_close, mlp, regression_data

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras

ACCUMULATION = 2
BATCH = 4
UPDATES = 4
SAMPLES = UPDATES * ACCUMULATION * BATCH


def _inner():
    return keras.optimizers.Adam(0.01)


@functools.cache
def plain_large_batch() -> list:
    x, y = regression_data(SAMPLES)
    model = mlp()
    model.compile(optimizer=_inner(), loss="mse")
    model.fit(x, y, batch_size=ACCUMULATION * BATCH, shuffle=False, verbose=0)
    return model.get_weights()


def accumulated(steps_per_execution: int) -> tuple:
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


def check_equals_the_large_batch(weights: list, expected: list) -> None:
    assert_weights_close(weights, expected, rtol=1e-5, atol=2e-6)
    assert not all(np.allclose(w, 0) for w in weights)

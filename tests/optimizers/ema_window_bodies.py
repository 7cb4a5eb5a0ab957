"""EMA of the weights when `fit` ends anywhere in an accumulation window
(issue 37 item 8), one body for both backends.

`GradientAccumulationOptimizer(Adam(use_ema=True), K)` after `n` micro-steps
must leave the model where the plain optimizer leaves it after `n // K`
steps on the large batch: the initial weights for `n < K` (no update yet:
the end-of-fit overwrite and `SwapEMAWeights` must not put unset averages
into the model), the large batch's averages otherwise. Imported by
`test_ema_window.py` (TensorFlow) and `test_ema_window_jax.py` (JAX).
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
from _training import mlp, regression_data

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras

ACCUMULATION = 3
BATCH = 4
# Micro-steps at which a fit ends: every position of the first window, the
# end of the first, and inside the second (complete windows only in the
# slow tier: other tests check them, and the two-fit case crosses one).
MICRO_STEPS = (
    1,
    2,
    pytest.param(3, marks=pytest.mark.slow),
    pytest.param(4, marks=pytest.mark.slow),
    pytest.param(5, marks=pytest.mark.slow),
)


def _inner():
    # A small EMA momentum keeps the averages visibly apart from the weights.
    return keras.optimizers.Adam(0.05, use_ema=True, ema_momentum=0.5)


def _data(micro_steps: int):
    # Drawn at one size and cut: `regression_data` draws its targets'
    # weights after the inputs, so its size changes the targets.
    x, y = regression_data(64)
    xv, yv = regression_data(8, seed=1)
    samples = micro_steps * BATCH
    return x[:samples], y[:samples], xv, yv


def _swap() -> list:
    # Keras 3's callback; tf_keras has none (its validation sees the
    # weights, for the plain and the accumulated run alike).
    swap = getattr(keras.callbacks, "SwapEMAWeights", None)
    return [swap()] if swap is not None else []


def _weights(model) -> list:
    return [np.asarray(w) for w in model.get_weights()]


def _close(actual: list, expected: list, atol: float = 1e-6) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=0, atol=atol)


def _accumulated_fit(micro_steps: int, fits: int = 1, scope=None) -> tuple:
    """(final weights, validation losses) of `fits` fits of `micro_steps`
    micro-batches each (the next samples each time), with `SwapEMAWeights`
    and validation data; model and optimizer made in `scope` (a
    `tf.distribute` strategy's) if given."""
    with scope or contextlib.nullcontext():
        model = mlp()
        model.compile(
            optimizer=GradientAccumulationOptimizer(_inner(), ACCUMULATION),
            loss="mse",
        )
    x, y, xv, yv = _data(micro_steps * fits)
    losses = []
    size = micro_steps * BATCH
    for fit in range(fits):
        part = slice(fit * size, (fit + 1) * size)
        history = model.fit(
            x[part],
            y[part],
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            validation_data=(xv, yv),
            callbacks=_swap(),
        )
        losses.extend(history.history["val_loss"])
    return _weights(model), losses


@functools.cache
def _plain(large_steps: int) -> tuple:
    """(final weights, validation loss) of the plain optimizer after
    `large_steps` steps on batches of `ACCUMULATION * BATCH` (0: the
    initial model, evaluated)."""
    model = mlp()
    model.compile(optimizer=_inner(), loss="mse")
    x, y, xv, yv = _data(large_steps * ACCUMULATION)
    if large_steps == 0:
        return _weights(model), model.evaluate(xv, yv, verbose=0)
    history = model.fit(
        x,
        y,
        batch_size=ACCUMULATION * BATCH,
        shuffle=False,
        verbose=0,
        validation_data=(xv, yv),
        callbacks=_swap(),
    )
    return _weights(model), history.history["val_loss"][-1]


def check_fit_ending_at(micro_steps: int, scope=None) -> None:
    """One fit of `micro_steps` micro-batches equals the plain optimizer
    after `micro_steps // K` large steps: final weights (after Keras's
    end-of-fit overwrite with the averages) and the validation loss
    `SwapEMAWeights` measured on the averages."""
    weights, losses = _accumulated_fit(micro_steps, scope=scope)
    expected_weights, expected_loss = _plain(micro_steps // ACCUMULATION)
    _close(weights, expected_weights)
    np.testing.assert_allclose(losses[-1], expected_loss, rtol=1e-5)
    if micro_steps < ACCUMULATION:
        # Nothing was lost: no weight became zero.
        assert all(np.all(w != 0.0) for w in weights[::2])


def check_fits_ending_inside_windows() -> None:
    """Two fits of 2 micro-steps each (K=3): the first ends inside the first
    window (model unchanged), the second completes it and ends inside the
    second; the model is then the plain optimizer's after one large step."""
    weights, losses = _accumulated_fit(2, fits=2)
    _, initial_loss = _plain(0)
    expected_weights, expected_loss = _plain(1)
    np.testing.assert_allclose(losses[0], initial_loss, rtol=1e-5)
    np.testing.assert_allclose(losses[1], expected_loss, rtol=1e-5)
    _close(weights, expected_weights)


def check_weights_set_inside_the_first_window() -> None:
    """Weights loaded between two fits inside the first window (K=3, one
    micro-step each) are what the second fit ends with and validates: the
    averages follow the weights at every micro-step until the first
    update, not only when the optimizer is built."""
    model = mlp()
    model.compile(
        optimizer=GradientAccumulationOptimizer(_inner(), ACCUMULATION),
        loss="mse",
    )
    x, y, xv, yv = _data(2)
    fit = dict(
        batch_size=BATCH, shuffle=False, verbose=0, validation_data=(xv, yv)
    )
    model.fit(x[:BATCH], y[:BATCH], callbacks=_swap(), **fit)
    loaded = [w * 0.5 for w in _weights(model)]
    model.set_weights(loaded)
    expected_loss = model.evaluate(xv, yv, verbose=0)
    history = model.fit(x[BATCH:], y[BATCH:], callbacks=_swap(), **fit)
    np.testing.assert_allclose(
        history.history["val_loss"][-1], expected_loss, rtol=1e-5
    )
    _close(_weights(model), loaded)

"""Shared check (both Keras flavours): momentum correction against the
closed form `u = m*u + g; w -= lr_t*u` on a linear model."""

from __future__ import annotations

import numpy as np

from keras_mgpu._flavour import keras
from keras_mgpu.optimizers import GradientAccumulationOptimizer
from keras_mgpu.schedules import Warmup

FEATURES = 5
MICRO = 4
MOMENTUM = 0.9
UPDATES = 7


def schedule():
    # Warmup over 3 updates, then a step decay: the rate changes at most
    # updates, so the correction matters.
    return Warmup(
        keras.optimizers.schedules.PiecewiseConstantDecay([2], [0.1, 0.03]),
        warmup_steps=3,
        initial_learning_rate=0.01,
    )


def data(replicas: int, accumulation: int):
    rng = np.random.default_rng(5)
    n = UPDATES * accumulation * MICRO * replicas
    x = rng.normal(size=(n, FEATURES)).astype("float32")
    y = (x @ rng.normal(size=(FEATURES, 1)) + 0.3).astype("float32")
    return x, y


def closed_form(x, y, large_batch: int, nesterov: bool) -> np.ndarray:
    """Rate-free momentum SGD on MSE, in float64, from zero weights."""
    w = np.zeros((FEATURES, 1))
    b = np.zeros((1,))
    u_w, u_b = np.zeros_like(w), np.zeros_like(b)
    rates = schedule()
    for t in range(UPDATES):
        xb = x[t * large_batch : (t + 1) * large_batch].astype("float64")
        yb = y[t * large_batch : (t + 1) * large_batch].astype("float64")
        error = xb @ w + b - yb
        g_w = 2.0 * xb.T @ error / len(xb)
        g_b = 2.0 * error.sum(axis=0) / len(xb)
        lr = float(rates(t))
        u_w = MOMENTUM * u_w + g_w
        u_b = MOMENTUM * u_b + g_b
        step_w = g_w + MOMENTUM * u_w if nesterov else u_w
        step_b = g_b + MOMENTUM * u_b if nesterov else u_b
        w, b = w - lr * step_w, b - lr * step_b
    return np.concatenate([w.ravel(), b])


def train(strategy, accumulation: int, correction: bool, nesterov: bool):
    replicas = strategy.num_replicas_in_sync
    x, y = data(replicas, accumulation)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((FEATURES,)),
                keras.layers.Dense(1, kernel_initializer="zeros"),
            ]
        )
        optimizer = GradientAccumulationOptimizer(
            keras.optimizers.SGD(
                schedule(), momentum=MOMENTUM, nesterov=nesterov
            ),
            accumulation,
            momentum_correction=correction,
        )
        model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=MICRO * replicas, shuffle=False, verbose=0)
    weights = np.concatenate([w.ravel() for w in model.get_weights()])
    expected = closed_form(x, y, MICRO * replicas * accumulation, nesterov)
    return weights, expected, optimizer

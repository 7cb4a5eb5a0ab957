"""Every component of the pack in one JAX `fit`, against the plain
computation: in-place recompute, gradient accumulation, LR scaling and
warmup and both monitors under `keras.distribution.DataParallel(4)` train a
model to the weights of one plain step per window on the K times larger
batch (no recompute, no accumulation, no monitors), to float rounding."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_mgpu
from keras_mgpu.callbacks import (
    GPULoadMonitor,
    LearningRateScaler,
    LearningRateWarmup,
    MemoryMonitor,
)
from keras_mgpu.testing import set_random_seed

DEVICES = 4
MICRO_BATCH = 8  # per device
K = 4
UPDATES = 6
WIDTH = 16


def _model():
    set_random_seed(0)
    return keras.Sequential(
        [keras.Input((WIDTH,))]
        + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(6)]
        + [keras.layers.Dense(3)]
    )


def _data():
    rng = np.random.default_rng(0)
    samples = DEVICES * MICRO_BATCH * K * UPDATES
    x = rng.normal(size=(samples, WIDTH)).astype("float32")
    y = rng.integers(0, 3, samples).astype("int32")
    return x, y


def _train(together: bool):
    distribution = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices("cpu")[:DEVICES]
    )
    x, y = _data()
    fit_batch = DEVICES * MICRO_BATCH * (1 if together else K)
    with distribution.scope():
        model = _model()
        optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
        if together:
            keras_mgpu.apply_recompute(model, policy="sqrt")
            optimizer = keras_mgpu.GradientAccumulationOptimizer(optimizer, K)
        model.compile(
            optimizer, keras.losses.SparseCategoricalCrossentropy(True)
        )
        callbacks = [
            LearningRateScaler(base_batch_size=64, batch_size=fit_batch),
            LearningRateWarmup(warmup_steps=3),
        ]
        if together:
            callbacks += [MemoryMonitor(), GPULoadMonitor(interval=0.05)]
        history = model.fit(
            x,
            y,
            batch_size=fit_batch,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    return model, history


@pytest.mark.slow
def test_every_component_together_trains_like_the_large_batch():
    together, history = _train(True)
    plain, _ = _train(False)
    assert keras_mgpu.recomputed_layers(together)
    assert int(together.optimizer.iterations) == 2 * UPDATES
    assert int(plain.optimizer.iterations) == 2 * UPDATES
    assert any(key.startswith("mem/") for key in history.history)
    for a, b in zip(together.get_weights(), plain.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # The run moved the weights: the comparison can fail.
    start = _model().get_weights()
    assert (
        max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(plain.get_weights(), start)
        )
        > 1e-2
    )

"""ThroughputMonitor in tf_keras's `fit`: the batch size and shapes come
from tf_keras's data handler, FLOPs from the traced graph."""

from __future__ import annotations

import numpy as np
import pytest

from keras_mgpu._flavour import keras
from keras_mgpu.callbacks import ThroughputMonitor


def test_rates_and_flops_in_tf_keras_fit():
    model = keras.Sequential(
        [
            keras.layers.Dense(64, activation="relu", input_shape=(32,)),
            keras.layers.Dense(4),
        ]
    )
    model.compile(
        "sgd", keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 32)).astype("float32")
    y = rng.integers(0, 4, 256)
    monitor = ThroughputMonitor(window_size=4)
    history = model.fit(
        x, y, batch_size=32, epochs=1, verbose=0, callbacks=[monitor]
    )
    logs = {k: v[-1] for k, v in history.history.items()}
    assert logs["perf/samples_per_sec"] == pytest.approx(
        logs["perf/batches_per_sec"] * 32
    )
    # 3 x forward: 2 x weights + biases + ReLU, per sample.
    forward = 2 * 32 * 64 + 64 + 64 + 2 * 64 * 4 + 4
    assert logs["perf/flops_per_sample"] == pytest.approx(3 * forward, rel=0.05)

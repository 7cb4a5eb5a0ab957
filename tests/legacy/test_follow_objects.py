"""Keras 3 objects in a TF_USE_LEGACY_KERAS=1 process: what Ray Train does
(it sets the variable on every worker while user code does `import
keras`). Every component must follow the user's Keras 3 objects, and train
exactly as in a Keras 3 process."""

from __future__ import annotations

import warnings

import keras as keras3
import numpy as np
import pytest
from conftest import make_strategy

import keras_mgpu
from keras_mgpu import callbacks as mgpu_callbacks
from keras_mgpu._flavour import FLAVOUR


def _model():
    keras3.utils.set_random_seed(3)
    return keras3.Sequential(
        [
            keras3.Input((3,)),
            keras3.layers.Dense(8, activation="tanh"),
            keras3.layers.Dense(1),
        ]
    )


def _data():
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(64, 3)).astype("float32"),
        rng.normal(size=(64, 1)).astype("float32"),
    )


def test_this_process_defaults_to_tf_keras():
    assert FLAVOUR == "tf_keras"


@pytest.mark.parametrize("name", ["default", "mirrored_2"])
def test_keras3_objects_get_keras3_components(name, tmp_path):
    x, y = _data()
    strategy = make_strategy(name)
    with strategy.scope():
        model = _model()
        optimizer = keras_mgpu.GradientAccumulationOptimizer(
            keras3.optimizers.SGD(keras_mgpu.Warmup(0.1, warmup_steps=3)), 2
        )
        model.compile(optimizer=optimizer, loss="mse")
    assert isinstance(optimizer, keras3.optimizers.Optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # monitors: no GPU here
        history = model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[
                mgpu_callbacks.LearningRateScaler(
                    base_batch_size=16,
                    per_replica_batch_size=8 // strategy.num_replicas_in_sync,
                ),
                mgpu_callbacks.LearningRateWarmup(warmup_steps=2),
                mgpu_callbacks.MemoryMonitor(),
                mgpu_callbacks.GPULoadMonitor(interval=0.05),
                mgpu_callbacks.BackupAndRestore(str(tmp_path / "b")),
            ],
        )
    # The same run with plain Keras 3 on the large batch: factor 1 (16/16).
    reference = _model()
    reference.compile(
        optimizer=keras3.optimizers.SGD(keras_mgpu.Warmup(0.1, 3)),
        loss="mse",
    )
    reference.fit(
        x,
        y,
        batch_size=16,
        epochs=2,
        shuffle=False,
        verbose=0,
        callbacks=[mgpu_callbacks.LearningRateWarmup(warmup_steps=2)],
    )
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert "mem/host_rss_mb" in history.history
    assert int(optimizer.iterations.numpy()) == 8


def test_keras3_warmup_round_trips_in_a_keras_file(tmp_path):
    model = _model()
    model.compile(
        optimizer=keras_mgpu.GradientAccumulationOptimizer(
            keras3.optimizers.Adam(
                keras_mgpu.Warmup(
                    keras3.optimizers.schedules.CosineDecay(0.01, 50), 5
                )
            ),
            3,
        ),
        loss="mse",
    )
    x, y = _data()
    model.fit(x, y, batch_size=8, verbose=0)
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras3.models.load_model(path)
    assert type(loaded.optimizer).__module__ == (
        "keras_mgpu.optimizers.gradient_accumulation"
    )
    schedule = loaded.optimizer.inner_optimizer._learning_rate
    assert isinstance(
        schedule.schedule, keras3.optimizers.schedules.CosineDecay
    )
    for a, b in zip(model.get_weights(), loaded.get_weights()):
        np.testing.assert_array_equal(a, b)

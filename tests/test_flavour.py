"""Components follow the Keras flavour of the objects they are given.

This process is the Keras 3 flavour (the package default); tf_keras
objects must still get tf_keras components. The reverse, Keras 3 objects in
a TF_USE_LEGACY_KERAS=1 process (what Ray Train does), is in
tests/legacy/test_follow_objects.py.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

import keras_mgpu
from keras_mgpu import callbacks as mgpu_callbacks
from keras_mgpu._flavour import FLAVOUR, keras

tf_keras = pytest.importorskip("tf_keras")


def _tf_keras_model():
    tf_keras.utils.set_random_seed(3)
    return tf_keras.Sequential(
        [
            tf_keras.Input((3,)),
            tf_keras.layers.Dense(4),
            tf_keras.layers.Dense(1),
        ]
    )


def _data():
    rng = np.random.default_rng(0)
    return (
        rng.normal(size=(32, 3)).astype("float32"),
        rng.normal(size=(32, 1)).astype("float32"),
    )


def test_package_default_is_keras3():
    assert FLAVOUR == "keras3"
    assert keras.version().startswith("3.")


def test_wrapper_follows_a_tf_keras_inner_optimizer():
    x, y = _data()
    optimizer = keras_mgpu.GradientAccumulationOptimizer(
        tf_keras.optimizers.SGD(0.1), 2
    )
    assert isinstance(optimizer, tf_keras.optimizers.Optimizer)
    model = _tf_keras_model()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, shuffle=False)
    reference = _tf_keras_model()
    reference.compile(optimizer=tf_keras.optimizers.SGD(0.1), loss="mse")
    reference.fit(x, y, batch_size=16, epochs=1, verbose=0, shuffle=False)
    assert int(optimizer.iterations.numpy()) == 2
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_subclass_keeps_its_flavour():
    class Mine(keras_mgpu.GradientAccumulationOptimizer):
        pass

    with pytest.raises(TypeError, match=r"`inner_optimizer` is a tf_keras"):
        Mine(tf_keras.optimizers.SGD(), 2)


def test_warmup_is_a_schedule_of_both_flavours():
    decay = tf_keras.optimizers.schedules.CosineDecay(0.1, 100)
    warmup = keras_mgpu.Warmup(decay, warmup_steps=4)
    assert isinstance(warmup, keras.optimizers.schedules.LearningRateSchedule)
    assert isinstance(
        warmup, tf_keras.optimizers.schedules.LearningRateSchedule
    )
    config = warmup.get_config()
    assert config["flavour"] == "tf_keras"
    again = keras_mgpu.Warmup.from_config(config)
    assert type(again.schedule) is type(decay)
    assert float(again(6)) == pytest.approx(float(warmup(6)))
    restored = tf_keras.optimizers.schedules.deserialize(
        tf_keras.optimizers.schedules.serialize(warmup)
    )
    assert float(restored(2)) == pytest.approx(float(warmup(2)))


def test_callbacks_run_in_a_tf_keras_fit(tmp_path):
    x, y = _data()
    model = _tf_keras_model()
    model.compile(
        optimizer=keras_mgpu.GradientAccumulationOptimizer(
            tf_keras.optimizers.SGD(keras_mgpu.Warmup(0.1, warmup_steps=4)),
            2,
        ),
        loss="mse",
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # monitors: no GPU here
        history = model.fit(
            x,
            y,
            batch_size=8,
            epochs=2,
            verbose=0,
            callbacks=[
                mgpu_callbacks.LearningRateScaler(
                    base_batch_size=8, per_replica_batch_size=8
                ),
                mgpu_callbacks.LearningRateWarmup(warmup_steps=2),
                mgpu_callbacks.MemoryMonitor(),
                mgpu_callbacks.GPULoadMonitor(interval=0.05),
                mgpu_callbacks.BackupAndRestore(str(tmp_path / "backup")),
            ],
        )
    assert "learning_rate" in history.history
    assert "mem/host_rss_mb" in history.history
    assert int(model.optimizer.iterations.numpy()) == 4

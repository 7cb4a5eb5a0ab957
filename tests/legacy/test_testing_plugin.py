"""keras_mgpu.testing in a tf_keras process: the plugin's devices and
strategies (this suite runs with it), and `assert_trains_like` on tf_keras
models."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import keras, make_strategy

from keras_mgpu.testing import assert_trains_like


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 6)).astype("float32")
    return x, rng.normal(size=(64, 1)).astype("float32")


def _dense():
    model = keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, "tanh"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_the_plugin_configured_four_devices(cpu_devices):
    assert len(cpu_devices) == 4


@pytest.mark.parametrize("name", ["mirrored_2", "mirrored_4"])
def test_a_tf_keras_model_trains_alike(name):
    assert "tf_keras" in type(_dense()).__module__
    differences = assert_trains_like(_dense, _data(), make_strategy(name))
    assert max(differences.values()) < 1e-5


def test_a_wrong_loss_scale_fails_naming_the_weight():
    def scaled_by_replicas():
        import tensorflow as tf

        model = _dense()
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        model.compile(
            optimizer=keras.optimizers.SGD(0.1 * replicas), loss="mse"
        )
        return model

    with pytest.raises(AssertionError, match=r"weight .* differs"):
        assert_trains_like(
            scaled_by_replicas, _data(), make_strategy("mirrored_2")
        )

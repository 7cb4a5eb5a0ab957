"""`keras_mgpu.testing.assert_trains_like` passes on a model that trains
alike and fails, naming the weight, on one that does not."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import keras, make_strategy

from keras_mgpu.testing import assert_trains_like


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(64, 6)).astype("float32"), rng.normal(
        size=(64, 1)
    ).astype("float32")


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


class ScalesByReplicas(keras.Model):
    """A train step that is wrong under replicas: it sums per-replica
    mean gradients as if they were a mean (a classic mistake)."""

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = self.compute_loss(x=x, y=y, y_pred=self(x, training=True))
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        grads = tape.gradient(loss, self.trainable_variables)
        grads = [g * replicas for g in grads]
        self.optimizer.apply(grads, self.trainable_variables)
        return {"loss": loss}


def _broken():
    inputs = keras.Input((6,))
    model = ScalesByReplicas(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


@pytest.mark.parametrize("name", ["one_device", "mirrored_2", "mirrored_4"])
def test_a_plain_model_trains_alike(name):
    differences = assert_trains_like(
        _dense, _data(), make_strategy(name), steps=4, rtol=1e-5, atol=1e-6
    )
    assert len(differences) == 4 and max(differences.values()) < 1e-5


def test_a_wrong_train_step_fails_naming_the_weight():
    assert_trains_like(_broken, _data(), make_strategy("one_device"))
    with pytest.raises(AssertionError, match=r"weight .*kernel.* differs"):
        assert_trains_like(_broken, _data(), make_strategy("mirrored_2"))


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="`steps` must be an integer >= 1"):
        assert_trains_like(_dense, _data(), make_strategy("default"), steps=0)
    with pytest.raises(ValueError, match="`data` must be a tuple"):
        assert_trains_like(_dense, [1], make_strategy("default"))

"""`keras_mgpu.testing.assert_trains_like` on JAX: a model trains to the
same weights under `DataParallel` / `ModelParallel` as without a
distribution, and a model that does not fails naming the weight."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_mgpu
from keras_mgpu.testing import assert_trains_like, make_strategy


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
    """A loss that is wrong under data parallelism: multiplied by the
    replica count, as code ported from a `tf.distribute` step that summed
    per-replica means does."""

    def compute_loss(self, *args, **kwargs):
        loss = super().compute_loss(*args, **kwargs)
        return loss * keras_mgpu.num_replicas_in_sync()


def _broken():
    inputs = keras.Input((6,))
    model = ScalesByReplicas(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


@pytest.mark.parametrize(
    "name", ["data_parallel_2", "data_parallel_4", "model_parallel_2x2"]
)
def test_a_plain_model_trains_alike(name):
    differences = assert_trains_like(
        _dense, _data(), make_strategy(name), steps=4, rtol=1e-5, atol=1e-6
    )
    assert len(differences) == 4 and max(differences.values()) < 1e-5


def test_the_model_parallel_entry_really_splits_the_kernel():
    distribution = make_strategy("model_parallel_2x2")
    with distribution.scope():
        model = _dense()
    hidden, output = model.layers
    assert tuple(hidden.kernel.value.sharding.spec) == (None, "model")
    # Dense(1) cannot be split in two: it stays replicated (JAX refuses
    # uneven shards), so a usual output layer builds under the matrix.
    assert tuple(output.kernel.value.sharding.spec) in ((), (None, None))


def test_a_wrong_loss_fails_naming_the_weight():
    assert_trains_like(_broken, _data(), "data_parallel_1")
    with pytest.raises(
        AssertionError,
        match=r"weight .*kernel.* under DataParallel \(mesh 2\) differs "
        r"from no distribution",
    ):
        assert_trains_like(_broken, _data(), "data_parallel_2")


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="`steps` must be an integer >= 1"):
        assert_trains_like(_dense, _data(), "default", steps=0)
    with pytest.raises(ValueError, match="`data` must be a tuple"):
        assert_trains_like(_dense, [1], "default")
    with pytest.raises(ValueError, match="Received: name='mirrored_2'"):
        assert_trains_like(_dense, _data(), "mirrored_2")

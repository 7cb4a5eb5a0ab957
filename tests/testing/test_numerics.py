"""`keras_mgpu.testing.assert_trains_like` passes on a model that trains
alike under the backend's strategies (TensorFlow: `tf.distribute`; JAX:
`DataParallel` / `ModelParallel`) and fails, naming the weight, on one that
does not."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import BACKEND, keras

import keras_mgpu
from keras_mgpu.testing import assert_trains_like, make_strategy

pytestmark = pytest.mark.backends("tensorflow", "jax")

# Per backend: a one-replica and a two-replica entry of the matrix, a name
# of the other backend's matrix (refused), and how a failure names the
# two-replica run.
ONE, TWO, OTHER, UNDER_TWO = {
    "tensorflow": (
        "one_device",
        "mirrored_2",
        "data_parallel_2",
        "under MirroredStrategy differs from _DefaultDistributionStrategy",
    ),
    "jax": (
        "data_parallel_1",
        "data_parallel_2",
        "mirrored_2",
        r"under DataParallel \(mesh 2\) differs from no distribution",
    ),
}[BACKEND]


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
    replica count, as a step that sums per-replica mean gradients as if
    they were a mean does (a classic mistake of `tf.distribute` code)."""

    def compute_loss(self, *args, **kwargs):
        loss = super().compute_loss(*args, **kwargs)
        return loss * keras_mgpu.num_replicas_in_sync()


def _broken():
    inputs = keras.Input((6,))
    model = ScalesByReplicas(inputs, keras.layers.Dense(1)(inputs))
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return model


def _on(backend, *names):
    return [pytest.param(n, marks=pytest.mark.backends(backend)) for n in names]


@pytest.mark.parametrize(
    "name",
    _on("tensorflow", "one_device", "mirrored_2", "mirrored_4")
    + _on("jax", "data_parallel_2", "data_parallel_4", "model_parallel_2x2"),
)
def test_a_plain_model_trains_alike(name):
    differences = assert_trains_like(
        _dense, _data(), make_strategy(name), steps=4, rtol=1e-5, atol=1e-6
    )
    assert len(differences) == 4 and max(differences.values()) < 1e-5


@pytest.mark.backends("jax")
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
    assert_trains_like(_broken, _data(), ONE)
    with pytest.raises(
        AssertionError,
        match=r"weight .*kernel.* " + UNDER_TWO,
    ):
        assert_trains_like(_broken, _data(), TWO)


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="`steps` must be an integer >= 1"):
        assert_trains_like(_dense, _data(), "default", steps=0)
    with pytest.raises(ValueError, match="`data` must be a tuple"):
        assert_trains_like(_dense, [1], "default")
    with pytest.raises(ValueError, match=f"Received: name='{OTHER}'"):
        assert_trains_like(_dense, _data(), OTHER)

"""The tf_keras GradientAccumulationOptimizer behaves as a plain tf_keras
optimizer would (issue 10): `set_weights`, `exclude_from_weight_decay`, the
clipping settings, sparse gradients; and Keras's optimizer test oracles,
which the tf_keras wheel does not ship.
"""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest
import tf_keras

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import IS_TF_KERAS, keras, tf

assert IS_TF_KERAS, "tests/legacy runs with TF_USE_LEGACY_KERAS=1"

RNG = np.random.default_rng(4)


def test_tf_keras_wheel_ships_no_optimizer_oracles():
    """The Keras 3 wrapper replays Keras's own optimizer tests
    (tests/optimizers/test_keras_oracles.py). tf_keras's wheel ships no
    tests: this skips saying so, and fails once a tf_keras release ships
    them, so that they get replayed too."""
    root = os.path.join(os.path.dirname(tf_keras.__file__), "src", "optimizers")
    shipped = sorted(
        glob.glob(os.path.join(root, "**", "*_test.py"), recursive=True)
    )
    if not shipped:
        pytest.skip(
            f"tf_keras {tf_keras.__version__} ships no optimizer tests "
            "(*_test.py) under tf_keras/src/optimizers/ in its wheel: no "
            "oracles to replay through the tf_keras wrapper"
        )
    pytest.fail(
        f"tf_keras {tf_keras.__version__} ships {len(shipped)} optimizer "
        "test files; replay them through the tf_keras wrapper as "
        f"tests/optimizers/keras_oracles.py does for Keras 3: {shipped[:3]}"
    )


def _trained_mid_window():
    variable = tf.Variable(np.ones((2, 3), "float32"))
    optimizer = GradientAccumulationOptimizer(keras.optimizers.Adam(0.1), 3)
    for _ in range(4):
        grad = RNG.normal(size=(2, 3)).astype("float32")
        optimizer.apply_gradients([(tf.constant(grad), variable)])
    return optimizer, variable


def test_set_weights_sets_the_inner_optimizer_state_too():
    source, source_variable = _trained_mid_window()
    variable = tf.Variable(source_variable.numpy())
    target = GradientAccumulationOptimizer(keras.optimizers.Adam(0.1), 3)
    target.build([variable])
    target.set_weights([v.numpy() for v in source.variables])
    for got, want in zip(target.variables, source.variables):
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    assert int(target.iterations) == 1
    for _ in range(5):
        grad = tf.constant(RNG.normal(size=(2, 3)).astype("float32"))
        source.apply_gradients([(grad, source_variable)])
        target.apply_gradients([(grad, variable)])
    np.testing.assert_allclose(variable.numpy(), source_variable.numpy())


def test_set_weights_errors():
    optimizer = GradientAccumulationOptimizer(keras.optimizers.SGD(), 2)
    with pytest.raises(ValueError, match="has not yet been built"):
        optimizer.set_weights([])
    optimizer.build([tf.Variable(np.zeros((2,), "float32"))])
    weights = [v.numpy() for v in optimizer.variables]
    with pytest.raises(ValueError, match="Argument `weights` must hold"):
        optimizer.set_weights(weights[1:])


def test_exclude_from_weight_decay_reaches_the_inner():
    decayed = tf.Variable(2.0, name="decayed")
    excluded = tf.Variable(2.0, name="excluded")
    optimizer = GradientAccumulationOptimizer(
        keras.optimizers.AdamW(1.0, weight_decay=0.1), 2
    )
    optimizer.exclude_from_weight_decay(var_names=["excluded"])
    for _ in range(2):
        optimizer.apply_gradients(
            [(tf.constant(0.0), decayed), (tf.constant(0.0), excluded)]
        )
    assert float(excluded.numpy()) == 2.0
    assert float(decayed.numpy()) == pytest.approx(2.0 - 2.0 * 0.1)


def test_clipping_settings_are_the_inner_ones():
    inner = keras.optimizers.SGD(0.1, global_clipnorm=0.5)
    optimizer = GradientAccumulationOptimizer(inner, 2)
    assert optimizer.global_clipnorm == 0.5
    assert optimizer.clipnorm is None
    optimizer.global_clipnorm = 0.25
    assert inner.global_clipnorm == 0.25


class ScatterUpdate(keras.optimizers.Optimizer):
    """Sets each row that has a gradient to that gradient (non-additive)."""

    def __init__(self):
        super().__init__(name="ScatterUpdate")
        self._learning_rate = self._build_learning_rate(0.001)

    def update_step(self, gradient, variable):
        if isinstance(gradient, tf.IndexedSlices):
            variable.scatter_update(gradient)
        else:
            variable.assign(gradient)


_MICRO = [
    ([[1.0, 2.0], [3.0, -1.0]], [0, 2]),
    ([[0.5, 0.5], [2.0, 2.0]], [2, 3]),
    ([[-4.0, 1.0]], [3]),
]


def _slices(values, indices):
    values = tf.constant(np.asarray(values, "float32"))
    return tf.IndexedSlices(values, tf.constant(indices), (6, 2))


@pytest.mark.parametrize("strategy_name", ["default", "mirrored_2"])
def test_sparse_gradients_stay_sparse(strategy_name):
    """Rows never looked up keep their value under a non-additive sparse
    update; the touched rows get the window's mean (under mirrored replicas
    tf_keras sums the replicas' slices and deduplicates the rows itself)."""
    from conftest import make_strategy

    strategy = make_strategy(strategy_name)
    with strategy.scope():
        variable = tf.Variable(np.full((6, 2), 7.0, "float32"))
        optimizer = GradientAccumulationOptimizer(ScatterUpdate(), len(_MICRO))

    @tf.function
    def step(values, indices):
        def replica_fn():
            # Every replica sees the same micro-batch; the mean over
            # replicas is that micro-batch's gradient.
            context = tf.distribute.get_replica_context()
            share = values / context.num_replicas_in_sync
            optimizer.apply_gradients(
                [(tf.IndexedSlices(share, indices, (6, 2)), variable)]
            )

        strategy.run(replica_fn)

    for values, indices in _MICRO:
        step(tf.constant(values, "float32"), tf.constant(indices))
    dense = np.zeros((6, 2), "float32")
    for values, indices in _MICRO:
        np.add.at(dense, indices, np.asarray(values, "float32"))
    expected = np.full((6, 2), 7.0, "float32")
    expected[[0, 2, 3]] = dense[[0, 2, 3]] / len(_MICRO)
    np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-6)

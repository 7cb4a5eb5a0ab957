"""Batch size by memory under tf_keras: the probe copies a tf_keras model
(under MirroredStrategy, the user's state untouched), and the planned
micro-batch and accumulation train like the plain global batch.

Memory is read from the fake allocator of `tests/batch_size/_fakes.py`
(`10 + 0.5 * batch` MB); the training steps are real.
"""

from __future__ import annotations

import numpy as np
from _training import assert_weights_close, mlp, regression_data
from batch_size import _fakes
from conftest import make_strategy

from keras_mgpu import GradientAccumulationOptimizer, configure_batch
from keras_mgpu._flavour import IS_TF_KERAS, keras, tf

assert IS_TF_KERAS, "tests/legacy runs with TF_USE_LEGACY_KERAS=1"

fake_allocator = _fakes.fake_allocator  # the fixture
GLOBAL_BATCH = 48
X, Y = regression_data(GLOBAL_BATCH * 4)


def test_configure_batch_under_mirrored(fake_allocator):
    strategy = make_strategy("mirrored_2")
    with strategy.scope():
        model = mlp()
        model.compile(keras.optimizers.Adam(0.01), loss="mse")
        model.optimizer.build(model.trainable_variables)
    rng = np.random.default_rng(3)
    for variable in model.weights + model.optimizer.variables:
        value = rng.normal(size=variable.shape)
        variable.assign(value.astype(variable.dtype.as_numpy_dtype))
    before = [np.array(v) for v in model.weights + model.optimizer.variables]
    setup = configure_batch(
        model,
        (X, Y),
        GLOBAL_BATCH,
        base_batch_size=16,
        # Micro-batches of at most 8 within the budget less the margin.
        memory_budget_mb=_fakes.budget_for(8),
        verbose=0,
    )
    after = [np.array(v) for v in model.weights + model.optimizer.variables]
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)
    assert all(
        isinstance(s, tf.distribute.OneDeviceStrategy)
        for s in fake_allocator.probe_strategies
    )
    assert (setup.per_replica_batch_size, setup.accumulation_steps) == (8, 3)
    assert isinstance(setup.optimizer, GradientAccumulationOptimizer)

    fresh = mlp()
    with strategy.scope():
        trained = keras.models.clone_model(fresh)
        trained.set_weights(fresh.get_weights())
        trained.compile(optimizer=setup.optimizer, loss="mse")
    trained.fit(
        X,
        Y,
        batch_size=setup.step_batch_size,
        shuffle=False,
        verbose=0,
        callbacks=setup.callbacks,
    )
    fresh.compile(keras.optimizers.Adam(setup.learning_rate), loss="mse")
    fresh.fit(X, Y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    assert_weights_close(trained.get_weights(), fresh.get_weights())

"""A `keras.optimizers.MultiOptimizer` inside GradientAccumulationOptimizer
with Keras's learning-rate callbacks (issue 37 item 9), on each backend.

Keras's `LearningRateScheduler` and `ReduceLROnPlateau` recognise a
MultiOptimizer by its `optimizers` attribute and set each sub-optimizer's
rate; a MultiOptimizer refuses `learning_rate` itself.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
from _training import assert_weights_close, mlp, regression_data

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras

pytestmark = pytest.mark.backends("tensorflow", "jax")

ACCUMULATION = 2
BATCH = 4


def _multi(model):
    first = keras.optimizers.SGD(0.1, momentum=0.5)
    rest = keras.optimizers.Adam(0.01)
    # The first layer's kernel and bias go to `first`.
    pattern = re.escape(model.layers[0].name) + "/.*"
    optimizer = keras.optimizers.MultiOptimizer(
        keras.optimizers.OptimizerMap(
            default_optimizer=rest, optimizer_map={pattern: first}
        )
    )
    return optimizer, first, rest


def _rates(*optimizers) -> list:
    return [
        float(keras.ops.convert_to_numpy(o.learning_rate)) for o in optimizers
    ]


def test_callbacks_set_the_sub_optimizers_rates():
    """Each callback's hook, called as `fit` calls it, halves both rates."""
    model = mlp()
    multi, first, rest = _multi(model)
    model.compile(
        optimizer=GradientAccumulationOptimizer(multi, ACCUMULATION),
        loss="mse",
    )
    scheduler = keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.5)
    scheduler.set_model(model)
    scheduler.on_epoch_begin(1)
    np.testing.assert_allclose(_rates(first, rest), [0.05, 0.005], rtol=1e-6)
    logs = {"loss": 1.0}  # not empty: Keras replaces an empty dict
    scheduler.on_epoch_end(1, logs)
    assert {f"learning_rate_{o.name}" for o in (first, rest)} < set(logs)

    plateau = keras.callbacks.ReduceLROnPlateau(
        monitor="val_loss", factor=0.5, patience=1
    )
    plateau.set_model(model)
    plateau.on_train_begin()
    plateau.on_epoch_end(0, {"val_loss": 1.0})
    plateau.on_epoch_end(1, {"val_loss": 1.0})
    np.testing.assert_allclose(_rates(first, rest), [0.025, 0.0025], rtol=1e-6)


def test_fit_with_a_schedule_equals_the_large_batch():
    """Two epochs with `LearningRateScheduler` halving the rates: the
    accumulated run equals the plain MultiOptimizer on the large batch."""
    x, y = regression_data(4 * ACCUMULATION * BATCH)
    results = []
    for accumulate in (True, False):
        model = mlp()
        multi, _, _ = _multi(model)
        optimizer = multi
        if accumulate:
            optimizer = GradientAccumulationOptimizer(multi, ACCUMULATION)
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(
            x,
            y,
            batch_size=BATCH * (ACCUMULATION if not accumulate else 1),
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=[
                keras.callbacks.LearningRateScheduler(lambda e, lr: lr * 0.5)
            ],
        )
        results.append(model.get_weights())
    assert_weights_close(results[0], results[1], rtol=1e-5, atol=1e-6)

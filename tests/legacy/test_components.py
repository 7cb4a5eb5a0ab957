"""The other keras_mgpu components under tf_keras, across the strategy
matrix: LR scaling and warmup (callbacks and schedule), both monitors and
RecomputeGrad, together with gradient accumulation in one `model.fit`.

Reference: the plain model (no recompute wrapper, no accumulation, no
callbacks) on one device at batch K·b, with the learning rate the
components should produce written out in closed form.
"""

from __future__ import annotations

import pytest
from _training import assert_weights_close, mlp, regression_data
from conftest import make_strategy

from keras_mgpu._flavour import keras, tf
from keras_mgpu.callbacks import (
    GPULoadMonitor,
    LearningRateScaler,
    LearningRateWarmup,
    MemoryMonitor,
)
from keras_mgpu.layers import RecomputeGrad, apply_recompute
from keras_mgpu.optimizers import GradientAccumulationOptimizer
from keras_mgpu.schedules import Warmup

ACCUMULATION = 3
MICRO_BATCH = 8
UPDATES = 4
X, Y = regression_data(ACCUMULATION * MICRO_BATCH * UPDATES)
BASE_LR = 0.02
# LearningRateScaler(base_batch_size=MICRO_BATCH) on K·b examples per update.
SCALED_LR = BASE_LR * ACCUMULATION
_cache: dict = {}


def _closed_form_lr():
    # Linear warmup over 2 updates from 0, then the scaled rate.
    return keras.optimizers.schedules.PiecewiseConstantDecay(
        [0, 1], [0.0, SCALED_LR / 2, SCALED_LR]
    )


def _reference() -> list:
    if "reference" not in _cache:
        model = mlp()
        model.compile(
            keras.optimizers.SGD(_closed_form_lr(), momentum=0.5), loss="mse"
        )
        model.fit(
            X,
            Y,
            batch_size=MICRO_BATCH * ACCUMULATION,
            shuffle=False,
            verbose=0,
        )
        _cache["reference"] = model.get_weights()
    return _cache["reference"]


def test_components_together_under_every_strategy(strategy):
    with strategy.scope():
        model = apply_recompute(
            mlp(), layers=keras.layers.Dense, in_place=False
        )
        model.compile(
            GradientAccumulationOptimizer(
                keras.optimizers.SGD(BASE_LR, momentum=0.5), ACCUMULATION
            ),
            loss="mse",
        )
    assert sum(isinstance(x, RecomputeGrad) for x in model.layers) == 3
    history = model.fit(
        X,
        Y,
        batch_size=MICRO_BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[
            LearningRateScaler(
                base_batch_size=MICRO_BATCH, batch_size=MICRO_BATCH, verbose=0
            ),
            LearningRateWarmup(warmup_steps=2),
            MemoryMonitor(warn_fraction=None),
            GPULoadMonitor(interval=0.05),
        ],
    )
    assert_weights_close(model.get_weights(), _reference())
    keys = set(history.history)
    assert any(k.startswith("mem/") for k in keys), keys
    assert any(k.startswith(("gpu/", "cpu/")) for k in keys), keys
    assert history.history["learning_rate"][-1] == pytest.approx(SCALED_LR)
    # The callbacks took their wrappers off: the base rate is back.
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(
        BASE_LR
    )


def test_warmup_schedule_with_accumulation_and_keras_file(tmp_path):
    strategy = make_strategy("mirrored_2")
    with strategy.scope():
        model = mlp()
        model.compile(
            GradientAccumulationOptimizer(
                keras.optimizers.SGD(
                    Warmup(SCALED_LR, warmup_steps=2), momentum=0.5
                ),
                ACCUMULATION,
            ),
            loss="mse",
        )
    model.fit(X, Y, batch_size=MICRO_BATCH, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), _reference())

    model.save(str(tmp_path / "model.keras"))
    with strategy.scope():
        loaded = keras.models.load_model(str(tmp_path / "model.keras"))
    schedule = loaded.optimizer.inner_optimizer._learning_rate
    assert isinstance(schedule, Warmup)
    assert schedule.get_config() == (
        model.optimizer.inner_optimizer._learning_rate.get_config()
    )
    for step in range(4):
        assert float(schedule(step)) == pytest.approx(
            float(_closed_form_lr()(step))
        )


def test_recompute_gradients_equal_plain_block():
    block = keras.Sequential(
        [
            keras.Input((X.shape[1],)),
            keras.layers.Dense(16, activation="tanh"),
            keras.layers.Dense(4),
        ]
    )
    wrapped = RecomputeGrad(block)
    x = tf.constant(X[:16])

    def grads(layer):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.square(layer(x, training=True)))
        return tape.gradient(loss, [x, *block.trainable_variables])

    for plain, recomputed in zip(grads(block), grads(wrapped), strict=True):
        assert_weights_close([recomputed], [plain], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored_2"])
def test_recompute_stateful_updates_run_once_per_step(strategy_name):
    # tf_keras has no StatelessScope: the wrapper restores the block's
    # non-trainable state around the recomputation. Without that a counter
    # ran 2x per step (3x for a Sequential block, whose mask was recomputed
    # by running it again) and BatchNormalization statistics moved too far.
    from _recompute_state import assert_updates_run_once

    assert_updates_run_once(make_strategy(strategy_name))

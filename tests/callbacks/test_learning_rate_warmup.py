"""LearningRateWarmup: the learning rate of every update against the closed
form, under accumulation, steps_per_execution, strategies and a resume."""

from __future__ import annotations

import numpy as np
import pytest
from callbacks._lr_argument_cases import WARMUP_CALLBACK_BAD_INPUT
from callbacks.lr_mw_bodies import (
    RecordingSGD,
    data,
    expected_warmup,
    tiny_model,
)

import keras_mgpu
from keras_mgpu._flavour import keras
from keras_mgpu.callbacks import LearningRateScaler, LearningRateWarmup
from keras_mgpu.schedules import Warmup

BATCH = 4
UPDATES = 12
WARMUP = 5
TARGET = 0.1
schedules = keras.optimizers.schedules


def _compile(strategy, accumulation, spe, learning_rate=TARGET):
    with strategy.scope():
        model = tiny_model()
        inner = RecordingSGD(learning_rate)
        optimizer = (
            keras_mgpu.GradientAccumulationOptimizer(inner, accumulation)
            if accumulation > 1
            else inner
        )
        model.compile(optimizer=optimizer, loss="mse", steps_per_execution=spe)
    return model, inner


def _fit(model, accumulation, callbacks, epochs=1, **kwargs):
    x, y = data(UPDATES * accumulation // epochs, BATCH)
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        verbose=0,
        shuffle=False,
        callbacks=callbacks,
        **kwargs,
    )


def _closed_form(updates, ramp, initial, target=TARGET, warmup=WARMUP):
    return [
        expected_warmup(n, warmup, initial, target, ramp)
        for n in range(updates)
    ]


# (strategy, accumulation, steps_per_execution, ramp). Mirrored with
# steps_per_execution > 1 fails in Keras 3.15 itself (keras-facts.md).
CASES = [
    ("default", 1, 4, "linear"),
    ("default", 4, 4, "cosine"),
    ("default", 4, 1, "exponential"),
    ("mirrored_2", 1, 1, "exponential"),
    ("mirrored_2", 4, 1, "linear"),
]


@pytest.mark.parametrize("strategy_name, accumulation, spe, ramp", CASES)
def test_callback_closed_form(strategy_name, accumulation, spe, ramp):
    from conftest import make_strategy

    initial = 0.01 if ramp == "exponential" else 0.0
    model, inner = _compile(make_strategy(strategy_name), accumulation, spe)
    history = _fit(
        model,
        accumulation,
        [
            LearningRateWarmup(
                warmup_steps=WARMUP, initial_learning_rate=initial, ramp=ramp
            )
        ],
        epochs=2,
    )
    recorded = inner.recorded()
    assert len(recorded) == UPDATES
    expected = _closed_form(UPDATES, ramp, initial)
    # Boundaries: update 0, last warmup update, first post-warmup update.
    assert recorded[0] == pytest.approx(initial, abs=1e-9)
    assert recorded[WARMUP - 1] == pytest.approx(expected[WARMUP - 1])
    assert recorded[WARMUP] == pytest.approx(TARGET)
    np.testing.assert_allclose(recorded, expected, rtol=1e-5, atol=1e-9)
    # `learning_rate` in the logs: the rate of the next update, once.
    lrs = history.history["learning_rate"]
    assert lrs == pytest.approx(
        [expected_warmup(6, WARMUP, initial, TARGET, ramp), TARGET]
    )
    # The original learning-rate variable is back: clean config.
    assert inner.get_config()["learning_rate"] == pytest.approx(TARGET)
    assert len(model.optimizer.variables) == len(model.optimizer.variables)


@pytest.mark.parametrize(
    "strategy_name, accumulation, spe, ramp",
    [("default", 4, 4, "exponential"), ("mirrored_2", 1, 1, "linear")],
)
def test_compiled_schedule_closed_form(strategy_name, accumulation, spe, ramp):
    from conftest import make_strategy

    nested = schedules.PiecewiseConstantDecay([2, 4], [0.1, 0.05, 0.02])
    initial = 0.01 if ramp == "exponential" else 0.0
    lr = Warmup(nested, WARMUP, initial_learning_rate=initial, ramp=ramp)
    model, inner = _compile(
        make_strategy(strategy_name), accumulation, spe, learning_rate=lr
    )
    _fit(model, accumulation, [])
    expected = [
        expected_warmup(n, WARMUP, initial, 0.1, ramp)
        if n < WARMUP
        else float(nested(n - WARMUP))
        for n in range(UPDATES)
    ]
    np.testing.assert_allclose(inner.recorded(), expected, rtol=1e-5)


def test_resume_after_interruption(tmp_path):
    """BackupAndRestore: the ramp continues from the restored counter."""
    accumulation, spe, epochs = 4, 4, 4
    per_epoch = UPDATES // epochs  # 3 updates per epoch: warmup spans 2

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    def run(extra):
        model, inner = _compile(
            keras.distribute.get_strategy()
            if hasattr(keras, "distribute")
            else __import__("tensorflow").distribute.get_strategy(),
            accumulation,
            spe,
        )
        callbacks = [
            keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
            LearningRateScaler(base_batch_size=BATCH, batch_size=BATCH),
            LearningRateWarmup(warmup_steps=WARMUP, ramp="cosine"),
            *extra,
        ]
        return _fit(model, accumulation, callbacks, epochs=epochs), inner

    with pytest.raises(RuntimeError, match="interrupted"):
        run([Interrupt()])
    history, inner = run([])
    # Resumed at epoch 2: 2 epochs ran in the second process of training.
    assert len(history.history["learning_rate"]) == 2
    target = TARGET * accumulation  # linear rule, 16 examples vs. base 4
    expected = _closed_form(UPDATES, "cosine", 0.0, target=target)
    assert per_epoch * 2 < UPDATES
    np.testing.assert_allclose(inner.recorded(), expected, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:LearningRateWarmup")
def test_second_fit_reuses_trace_and_plain_fit_is_clean(tmp_path, monkeypatch):
    import tensorflow as tf

    from keras_mgpu.schedules import _optimizer_lr

    traces = []
    transform = _optimizer_lr.WarmupWrapper.transform

    def counting(self, target):
        if tf.inside_function():
            traces.append(1)
        return transform(self, target)

    monkeypatch.setattr(_optimizer_lr.WarmupWrapper, "transform", counting)
    model, inner = _compile(keras_mgpu.distribute.current_strategy(), 1, 2)
    warmup = LearningRateWarmup(warmup_steps=40)
    _fit(model, 1, [warmup])
    traced = model._keras_mgpu_lr_traced.function
    first = len(traces)
    assert first >= 1
    _fit(model, 1, [warmup])
    assert model._keras_mgpu_lr_traced.function is traced
    assert len(traces) == first  # the second fit did not retrace
    np.testing.assert_allclose(
        inner.recorded(), [TARGET * n / 40 for n in range(24)], rtol=1e-5
    )
    # Without the callback: the original constant rate, no stale ramp.
    _fit(model, 1, [])
    np.testing.assert_allclose(inner.recorded()[24:], TARGET, rtol=1e-6)
    # And the model saves with the plain learning rate.
    path = str(tmp_path / "m.keras")
    model.save(path)
    loaded = keras.models.load_model(
        path, custom_objects={"RecordingSGD": RecordingSGD}
    )
    assert float(loaded.optimizer.learning_rate) == pytest.approx(TARGET)


def test_composes_with_learning_rate_scheduler():
    """LearningRateScheduler sets the target the ramp heads for."""
    model, inner = _compile(keras_mgpu.distribute.current_strategy(), 1, 1)
    targets = [0.1, 0.1, 0.03, 0.03]
    history = _fit(
        model,
        1,
        [
            LearningRateWarmup(warmup_steps=WARMUP),
            keras.callbacks.LearningRateScheduler(lambda e: targets[e]),
        ],
        epochs=4,
    )
    expected = [
        expected_warmup(n, WARMUP, 0.0, targets[n // 3], "linear")
        for n in range(UPDATES)
    ]
    np.testing.assert_allclose(inner.recorded(), expected, rtol=1e-5)
    assert history.history["learning_rate"] == pytest.approx(
        [
            expected_warmup(3, WARMUP, 0.0, 0.1, "linear"),
            0.1,
            0.03,
            0.03,
        ]
    )


def test_warmup_epochs_and_wrapped_loss_scale():
    """Epochs convert through fit's steps and the accumulation steps; works
    through LossScaleOptimizer(GradientAccumulationOptimizer(...))."""
    with keras_mgpu.distribute.current_strategy().scope():
        model = tiny_model()
        inner = RecordingSGD(TARGET)
        optimizer = keras.optimizers.LossScaleOptimizer(
            keras_mgpu.GradientAccumulationOptimizer(inner, 2)
        )
        model.compile(optimizer=optimizer, loss="mse")
    # 8 batches per epoch / 2 accumulation = 4 updates; 1.5 epochs -> 6.
    x, y = data(8, BATCH)
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=3,
        verbose=0,
        callbacks=[LearningRateWarmup(warmup_epochs=1.5)],
    )
    expected = _closed_form(12, "linear", 0.0, warmup=6)
    np.testing.assert_allclose(inner.recorded(), expected, rtol=1e-5)


def test_warmup_longer_than_training_warns():
    model, inner = _compile(keras_mgpu.distribute.current_strategy(), 1, 1)
    with pytest.warns(UserWarning, match=r"warmup_steps=100 is longer"):
        _fit(model, 1, [LearningRateWarmup(warmup_steps=100)])
    assert inner.recorded()[-1] == pytest.approx(TARGET * 11 / 100)


@pytest.mark.parametrize("kwargs, error, match", WARMUP_CALLBACK_BAD_INPUT)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        LearningRateWarmup(**kwargs)


def test_warmup_epochs_needs_steps():
    import tensorflow as tf

    model, _ = _compile(keras_mgpu.distribute.current_strategy(), 1, 1)
    x, y = data(4, BATCH)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    dataset = dataset.filter(lambda a, b: True)  # unknown cardinality
    with pytest.raises(ValueError, match=r"needs the number of steps per"):
        model.fit(
            dataset,
            epochs=1,
            verbose=0,
            callbacks=[LearningRateWarmup(warmup_epochs=1)],
        )

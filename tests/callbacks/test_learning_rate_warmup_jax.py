"""LearningRateWarmup on JAX: the rate the jitted step uses at every
update against the closed form, under no distribution, DataParallel and
ModelParallel, with accumulation (Keras's built-in and a wrapper), across a
BackupAndRestore resume, and composed with Keras's LR callbacks."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from callbacks._lr_argument_cases import WARMUP_CALLBACK_BAD_INPUT
from callbacks.lr_jax_helpers import (
    RecordingSGD,
    StandInAccumulation,
    data,
    expected_warmup,
    make_distribution,
    replicas_of,
    scope,
    tiny_model,
)

from keras_mgpu.backend import BackendNotSupportedError
from keras_mgpu.callbacks import LearningRateScaler, LearningRateWarmup
from keras_mgpu.schedules import Warmup, _optimizer_lr

PER_REPLICA = 2
UPDATES = 12
WARMUP = 5
TARGET = 0.1


def _compile(name, accumulation=1, wrapper=False, spe=1, lr=TARGET):
    distribution = make_distribution(name)
    with scope(distribution):
        model = tiny_model()
        inner = RecordingSGD(
            lr,
            gradient_accumulation_steps=accumulation
            if accumulation > 1
            else None,
        )
        optimizer = StandInAccumulation(inner) if wrapper else inner
        model.compile(optimizer=optimizer, loss="mse", steps_per_execution=spe)
    return model, inner, distribution


def _fit(model, distribution, accumulation, callbacks, epochs=1, **kwargs):
    kind = "none" if distribution is None else _kind(distribution)
    batch = PER_REPLICA * replicas_of(kind)
    x, y = data(UPDATES * accumulation // epochs, batch)
    with scope(distribution):
        return model.fit(
            x,
            y,
            batch_size=batch,
            epochs=epochs,
            verbose=0,
            shuffle=False,
            callbacks=callbacks,
            **kwargs,
        )


def _kind(distribution):
    if isinstance(distribution, keras.distribution.DataParallel):
        return "data_parallel"
    return "model_parallel"


def _closed_form(updates, ramp, initial, target=TARGET, warmup=WARMUP):
    return [
        expected_warmup(n, warmup, initial, target, ramp)
        for n in range(updates)
    ]


# (distribution, accumulation, wrapper, steps_per_execution, ramp)
CASES = [
    ("none", 2, True, 4, "linear"),
    ("data_parallel", 2, False, 1, "cosine"),
    ("model_parallel", 1, False, 2, "exponential"),
]


@pytest.mark.parametrize("name, accumulation, wrapper, spe, ramp", CASES)
def test_callback_closed_form(name, accumulation, wrapper, spe, ramp):
    initial = 0.01 if ramp == "exponential" else 0.0
    model, inner, distribution = _compile(name, accumulation, wrapper, spe)
    warmup = LearningRateWarmup(
        warmup_steps=WARMUP, initial_learning_rate=initial, ramp=ramp
    )
    history = _fit(model, distribution, accumulation, [warmup], epochs=2)
    recorded = inner.recorded()
    assert len(recorded) == UPDATES  # counted in updates, not micro-steps
    expected = _closed_form(UPDATES, ramp, initial)
    assert recorded[0] == pytest.approx(initial, abs=1e-9)
    assert recorded[WARMUP] == pytest.approx(TARGET)
    np.testing.assert_allclose(recorded, expected, rtol=1e-5, atol=1e-9)
    # `learning_rate` in the logs: the rate of the next update.
    assert history.history["learning_rate"] == pytest.approx(
        [expected_warmup(6, WARMUP, initial, TARGET, ramp), TARGET]
    )
    # The original learning-rate variable is back: clean config.
    assert isinstance(inner._learning_rate, keras.Variable)
    assert inner.get_config()["learning_rate"] == pytest.approx(TARGET)


def test_resume_with_backup_and_restore(tmp_path):
    """Interrupted at epoch 2 of 4 under DataParallel and resumed by
    Keras's BackupAndRestore: the ramp continues from the restored counter,
    and the scaler scales it (4 replicas x 2 examples vs. base 2)."""
    epochs = 4

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    def run(extra):
        model, inner, distribution = _compile("data_parallel", spe=2)
        callbacks = [
            keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
            LearningRateScaler(base_batch_size=2, per_replica_batch_size=2),
            LearningRateWarmup(warmup_steps=WARMUP, ramp="cosine"),
            *extra,
        ]
        history = _fit(model, distribution, 1, callbacks, epochs=epochs)
        return history, inner

    with pytest.raises(RuntimeError, match="interrupted"):
        run([Interrupt()])
    history, inner = run([])
    assert len(history.history["learning_rate"]) == 2  # epochs 2 and 3
    expected = _closed_form(UPDATES, "cosine", 0.0, target=TARGET * 4)
    np.testing.assert_allclose(inner.recorded(), expected, rtol=1e-5)


def test_keras_callbacks_compose_and_traces_are_reused(monkeypatch):
    """LearningRateScheduler sets the target the ramp heads for; a second
    fit with the same callback reuses the compiled step; a plain fit after
    it uses the plain rate."""
    traces = []
    transform = _optimizer_lr.WarmupWrapper.transform

    def counting(self, target):
        if isinstance(target, jax.core.Tracer):
            traces.append(1)
        return transform(self, target)

    monkeypatch.setattr(_optimizer_lr.WarmupWrapper, "transform", counting)
    model, inner, _ = _compile("none")
    targets = [0.1, 0.1, 0.03, 0.03]
    warmup = LearningRateWarmup(warmup_steps=WARMUP)
    history = _fit(
        model,
        None,
        1,
        [
            warmup,
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
        [expected_warmup(3, WARMUP, 0.0, 0.1, "linear"), 0.1, 0.03, 0.03]
    )
    first = len(traces)
    assert first >= 1
    _fit(model, None, 1, [warmup], epochs=2)  # warmup is over: target
    assert len(traces) == first  # the second fit did not retrace
    _fit(model, None, 1, [], epochs=2)  # plain: the variable's rate
    np.testing.assert_allclose(inner.recorded()[12:], 0.03, rtol=1e-6)
    assert len(traces) == first


def test_warmup_epochs_through_accumulation_and_warning():
    """Epochs convert through fit's steps and the accumulation steps (8
    batches / 2 = 4 updates per epoch; 1.5 epochs -> 6); a ramp longer
    than the training warns."""
    model, inner, distribution = _compile("none", 2, wrapper=True)
    x, y = data(8, PER_REPLICA)
    model.fit(
        x,
        y,
        batch_size=PER_REPLICA,
        epochs=3,
        verbose=0,
        callbacks=[LearningRateWarmup(warmup_epochs=1.5)],
    )
    expected = _closed_form(12, "linear", 0.0, warmup=6)
    np.testing.assert_allclose(inner.recorded(), expected, rtol=1e-5)
    with pytest.warns(UserWarning, match=r"warmup_steps=100 is longer"):
        model.fit(
            x,
            y,
            batch_size=PER_REPLICA,
            verbose=0,
            callbacks=[LearningRateWarmup(warmup_steps=100)],
        )
    assert inner.recorded()[-1] == pytest.approx(TARGET * 15 / 100)


def test_warmup_epochs_needs_steps():
    model, _, _ = _compile("none")
    x, y = data(4, PER_REPLICA)

    def batches():
        for i in range(4):
            yield x[i * 2 : i * 2 + 2], y[i * 2 : i * 2 + 2]

    with pytest.raises(ValueError, match=r"needs the number of steps per"):
        model.fit(
            batches(),
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=[LearningRateWarmup(warmup_epochs=1)],
        )


@pytest.mark.parametrize("kwargs, error, match", WARMUP_CALLBACK_BAD_INPUT)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        LearningRateWarmup(**kwargs)


@pytest.mark.parametrize(
    "build",
    [
        lambda: LearningRateWarmup(warmup_steps=2),
        lambda: LearningRateScaler(base_batch_size=8),
        lambda: Warmup(0.1, 2),
    ],
)
def test_other_backends_are_refused_at_construction(monkeypatch, build):
    import keras_mgpu.backend

    monkeypatch.setattr(keras_mgpu.backend, "backend", lambda: "torch")
    with pytest.raises(BackendNotSupportedError, match=r"'torch' backend"):
        build()

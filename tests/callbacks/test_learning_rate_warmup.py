"""LearningRateWarmup on both backends: the rate the compiled step uses at
every update against the closed form, under accumulation,
steps_per_execution, the strategies or distributions, across a
BackupAndRestore resume, and composed with Keras's LR callbacks."""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest
from callbacks import lr_jax_helpers
from callbacks._lr_argument_cases import WARMUP_CALLBACK_BAD_INPUT
from callbacks._lr_recording import (
    JAX,
    RecordingSGD,
    data,
    expected_warmup,
    tiny_model,
)

from keras_mgpu.backend import BackendNotSupportedError
from keras_mgpu.callbacks import LearningRateScaler, LearningRateWarmup
from keras_mgpu.schedules import Warmup, _optimizer_lr

pytestmark = pytest.mark.backends("tensorflow", "jax")

TF_ONLY = pytest.mark.backends("tensorflow")
JAX_ONLY = pytest.mark.backends("jax")

BATCH = 4  # TensorFlow: the global batch under every strategy
PER_REPLICA = 2  # JAX: the batch per data-parallel replica
UPDATES = 12
WARMUP = 5
TARGET = 0.1
schedules = keras.optimizers.schedules


class Rig:
    """A compiled model of one case and how to fit it, per backend.

    TensorFlow: built in the strategy's scope, accumulation through
    keras_mgpu's `GradientAccumulationOptimizer`, a global batch of 4.
    JAX: built and fitted in the distribution's scope (Keras reads the one
    in force to split the batch), Keras's own accumulation, bare or in a
    wrapper shaped like keras_mgpu's, 2 examples per replica.
    """

    def __init__(
        self, name="default", accumulation=1, wrapper=False, spe=1, lr=TARGET
    ):
        self.accumulation = accumulation
        if JAX:
            distribution = lr_jax_helpers.make_distribution(
                "none" if name == "default" else name
            )
            self.scope = lambda: lr_jax_helpers.scope(distribution)
            self.batch = PER_REPLICA * lr_jax_helpers.replicas_of(
                "none" if name == "default" else name
            )
            with self.scope():
                self.model = tiny_model()
                self.inner = RecordingSGD(
                    lr,
                    gradient_accumulation_steps=accumulation
                    if accumulation > 1
                    else None,
                )
                optimizer = (
                    lr_jax_helpers.StandInAccumulation(self.inner)
                    if wrapper
                    else self.inner
                )
                self.model.compile(
                    optimizer=optimizer, loss="mse", steps_per_execution=spe
                )
            return
        from conftest import make_strategy

        import keras_mgpu

        self.scope, self.batch = contextlib.nullcontext, BATCH
        with make_strategy(name).scope():
            self.model = tiny_model()
            self.inner = RecordingSGD(lr)
            optimizer = (
                keras_mgpu.GradientAccumulationOptimizer(
                    self.inner, accumulation
                )
                if accumulation > 1
                else self.inner
            )
            self.model.compile(
                optimizer=optimizer, loss="mse", steps_per_execution=spe
            )

    def fit(self, callbacks, epochs=1, updates=UPDATES, **kwargs):
        x, y = data(updates * self.accumulation // epochs, self.batch)
        with self.scope():
            return self.model.fit(
                x,
                y,
                batch_size=self.batch,
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


def _case(name, accumulation, wrapper, spe, ramp, marks):
    return pytest.param(name, accumulation, wrapper, spe, ramp, marks=marks)


# (strategy or distribution, accumulation, wrapper, steps_per_execution,
# ramp). Mirrored with steps_per_execution > 1 fails in Keras 3.15 itself
# (keras-facts.md).
CASES = [
    _case("default", 1, False, 4, "linear", TF_ONLY),
    _case("default", 4, False, 4, "cosine", TF_ONLY),
    _case("default", 4, False, 1, "exponential", TF_ONLY),
    _case("mirrored_2", 1, False, 1, "exponential", TF_ONLY),
    _case("mirrored_2", 4, False, 1, "linear", TF_ONLY),
    _case("default", 2, True, 4, "linear", JAX_ONLY),
    _case("data_parallel", 2, False, 1, "cosine", JAX_ONLY),
    _case("model_parallel", 1, False, 2, "exponential", JAX_ONLY),
]


@pytest.mark.parametrize("name, accumulation, wrapper, spe, ramp", CASES)
def test_callback_closed_form(name, accumulation, wrapper, spe, ramp):
    initial = 0.01 if ramp == "exponential" else 0.0
    rig = Rig(name, accumulation, wrapper, spe)
    warmup = LearningRateWarmup(
        warmup_steps=WARMUP, initial_learning_rate=initial, ramp=ramp
    )
    history = rig.fit([warmup], epochs=2)
    recorded = rig.inner.recorded()
    assert len(recorded) == UPDATES  # counted in updates, not micro-steps
    expected = _closed_form(UPDATES, ramp, initial)
    # Boundaries: update 0, last warmup update, first post-warmup update.
    assert recorded[0] == pytest.approx(initial, abs=1e-9)
    assert recorded[WARMUP - 1] == pytest.approx(expected[WARMUP - 1])
    assert recorded[WARMUP] == pytest.approx(TARGET)
    np.testing.assert_allclose(recorded, expected, rtol=1e-5, atol=1e-9)
    # `learning_rate` in the logs: the rate of the next update, once.
    assert history.history["learning_rate"] == pytest.approx(
        [expected_warmup(6, WARMUP, initial, TARGET, ramp), TARGET]
    )
    # The original learning-rate variable is back: clean config.
    assert isinstance(rig.inner._learning_rate, keras.Variable)
    assert rig.inner.get_config()["learning_rate"] == pytest.approx(TARGET)


@TF_ONLY
@pytest.mark.parametrize(
    "name, accumulation, spe, ramp",
    [("default", 4, 4, "exponential"), ("mirrored_2", 1, 1, "linear")],
)
def test_compiled_schedule_closed_form(name, accumulation, spe, ramp):
    nested = schedules.PiecewiseConstantDecay([2, 4], [0.1, 0.05, 0.02])
    initial = 0.01 if ramp == "exponential" else 0.0
    lr = Warmup(nested, WARMUP, initial_learning_rate=initial, ramp=ramp)
    rig = Rig(name, accumulation, spe=spe, lr=lr)
    rig.fit([])
    expected = [
        expected_warmup(n, WARMUP, initial, 0.1, ramp)
        if n < WARMUP
        else float(nested(n - WARMUP))
        for n in range(UPDATES)
    ]
    np.testing.assert_allclose(rig.inner.recorded(), expected, rtol=1e-5)


# (rig, scaler arguments): both scale the ramp's target by 4 (TensorFlow:
# 4 accumulation steps x 4 examples vs. base 4; JAX: DataParallel, 4
# replicas x 2 examples vs. base 2).
RESUME_CASES = [
    pytest.param(
        {"accumulation": 4, "spe": 4},
        {"base_batch_size": BATCH, "batch_size": BATCH},
        marks=TF_ONLY,
        id="accumulation",
    ),
    pytest.param(
        {"name": "data_parallel", "spe": 2},
        {"base_batch_size": 2, "per_replica_batch_size": 2},
        marks=JAX_ONLY,
        id="data_parallel",
    ),
]


@pytest.mark.parametrize("rig_kwargs, scaler_kwargs", RESUME_CASES)
def test_resume_with_backup_and_restore(tmp_path, rig_kwargs, scaler_kwargs):
    """Interrupted at epoch 2 of 4 and resumed by Keras's BackupAndRestore:
    the ramp continues from the restored counter, scaled by the scaler."""

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("interrupted")

    def run(extra):
        rig = Rig(**rig_kwargs)
        callbacks = [
            keras.callbacks.BackupAndRestore(str(tmp_path / "backup")),
            LearningRateScaler(**scaler_kwargs),
            LearningRateWarmup(warmup_steps=WARMUP, ramp="cosine"),
            *extra,
        ]
        return rig.fit(callbacks, epochs=4), rig.inner

    with pytest.raises(RuntimeError, match="interrupted"):
        run([Interrupt()])
    history, inner = run([])
    assert len(history.history["learning_rate"]) == 2  # epochs 2 and 3
    expected = _closed_form(UPDATES, "cosine", 0.0, target=TARGET * 4)
    np.testing.assert_allclose(inner.recorded(), expected, rtol=1e-5)


def _tracing(value) -> bool:
    """Whether `value` is being traced into the compiled step."""
    if JAX:
        import jax

        return isinstance(value, jax.core.Tracer)
    import tensorflow as tf

    return tf.inside_function()


@pytest.mark.filterwarnings("ignore:LearningRateWarmup")
def test_second_fit_reuses_trace_and_plain_fit_is_clean(tmp_path, monkeypatch):
    traces = []
    transform = _optimizer_lr.WarmupWrapper.transform

    def counting(self, target):
        if _tracing(target):
            traces.append(1)
        return transform(self, target)

    monkeypatch.setattr(_optimizer_lr.WarmupWrapper, "transform", counting)
    rig = Rig(spe=2)
    warmup = LearningRateWarmup(warmup_steps=40)
    rig.fit([warmup])
    traced = rig.model._keras_mgpu_lr_traced.function
    first = len(traces)
    assert first >= 1
    rig.fit([warmup])
    assert rig.model._keras_mgpu_lr_traced.function is traced
    assert len(traces) == first  # the second fit did not retrace
    np.testing.assert_allclose(
        rig.inner.recorded(), [TARGET * n / 40 for n in range(24)], rtol=1e-5
    )
    # Without the callback: the original constant rate, no stale ramp.
    rig.fit([])
    np.testing.assert_allclose(rig.inner.recorded()[24:], TARGET, rtol=1e-6)
    assert len(traces) == first
    # And the model saves with the plain learning rate.
    path = str(tmp_path / "m.keras")
    rig.model.save(path)
    loaded = keras.models.load_model(
        path, custom_objects={"RecordingSGD": RecordingSGD}
    )
    assert float(loaded.optimizer.learning_rate) == pytest.approx(TARGET)


def test_composes_with_learning_rate_scheduler():
    """LearningRateScheduler sets the target the ramp heads for."""
    rig = Rig()
    targets = [0.1, 0.1, 0.03, 0.03]
    history = rig.fit(
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
    np.testing.assert_allclose(rig.inner.recorded(), expected, rtol=1e-5)
    assert history.history["learning_rate"] == pytest.approx(
        [expected_warmup(3, WARMUP, 0.0, 0.1, "linear"), 0.1, 0.03, 0.03]
    )


def _accumulating_optimizer():
    """(recording optimizer, what `compile` gets): an accumulation of 2
    inside a LossScaleOptimizer, keras_mgpu's `GradientAccumulationOptimizer`
    (TensorFlow) or Keras's own in a LossScaleOptimizer subclass shaped like
    it (JAX)."""
    if JAX:
        inner = RecordingSGD(TARGET, gradient_accumulation_steps=2)
        return inner, lr_jax_helpers.StandInAccumulation(inner)
    import keras_mgpu

    inner = RecordingSGD(TARGET)
    return inner, keras.optimizers.LossScaleOptimizer(
        keras_mgpu.GradientAccumulationOptimizer(inner, 2)
    )


def test_warmup_epochs_through_accumulation_and_loss_scale():
    """Epochs convert through fit's steps and the accumulation steps (8
    batches / 2 = 4 updates per epoch; 1.5 epochs -> 6), through a
    LossScaleOptimizer around the accumulation."""
    model = tiny_model()
    inner, optimizer = _accumulating_optimizer()
    model.compile(optimizer=optimizer, loss="mse")
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
    rig = Rig()
    with pytest.warns(UserWarning, match=r"warmup_steps=100 is longer"):
        rig.fit([LearningRateWarmup(warmup_steps=100)])
    assert rig.inner.recorded()[-1] == pytest.approx(TARGET * 11 / 100)


def _generator(x, y):
    for i in range(len(x) // BATCH):
        yield x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]


def _filtered_dataset(x, y):
    import tensorflow as tf

    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH)
    return dataset.filter(lambda a, b: True)  # unknown cardinality


@pytest.mark.parametrize(
    "make_input",
    [_generator, pytest.param(_filtered_dataset, marks=TF_ONLY)],
    ids=["generator", "tf_data"],
)
def test_warmup_epochs_needs_steps(make_input):
    rig = Rig()
    x, y = data(4, BATCH)
    with pytest.raises(ValueError, match=r"needs the number of steps per"):
        rig.model.fit(
            make_input(x, y),
            epochs=1,
            verbose=0,
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

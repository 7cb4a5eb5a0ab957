"""A new `LearningRateWarmup` / `LearningRateScaler` (same or other numbers)
in a later `fit` reuses the compiled train step: no retrace on TensorFlow,
no XLA compilation on JAX, as with Keras's `LearningRateScheduler`; and the
later `fit` runs the *new* numbers (read from the step's state, not from
constants of the first trace).

Collected by both backends' jobs. Traces are counted by a Python counter
in a layer's `call` (it runs once per trace); on JAX compilations by
`jax.monitoring`'s backend-compile event.
"""

from __future__ import annotations

import contextlib
import warnings

import keras
import numpy as np
import pytest
from callbacks.lr_jax_helpers import RecordingSGD, expected_warmup

from keras_mgpu.callbacks import LearningRateScaler, LearningRateWarmup

BATCH = 4
STEPS = 4  # updates per fit
TARGET = 0.1

pytestmark = pytest.mark.backends("tensorflow", "jax")


class CountingDense(keras.layers.Dense):
    """Dense that counts how often its `call` is traced."""

    traces = 0

    def call(self, inputs):
        type(self).traces += 1
        return super().call(inputs)


def _model() -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((3,)),
            CountingDense(
                1, kernel_initializer=keras.initializers.Constant(0.1)
            ),
        ]
    )
    model.compile(optimizer=RecordingSGD(TARGET), loss="mse")
    return model


def _fit(model, callbacks) -> None:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(STEPS * BATCH, 3)).astype("float32")
    model.fit(
        x,
        x[:, :1],
        batch_size=BATCH,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
    )


@contextlib.contextmanager
def _jax_compilations():
    import jax
    from jax._src import dispatch

    events = []

    def listener(event, duration, **kwargs):
        if event == dispatch.BACKEND_COMPILE_EVENT:
            events.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield lambda: len(events)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def count_work():
    """A context giving a function: traces (TensorFlow) or compilations
    (JAX) so far."""
    if keras.backend.backend() == "jax":
        return _jax_compilations()
    return contextlib.nullcontext(lambda: CountingDense.traces)


# Each case: the callbacks of the first and the second `fit` with them, and
# the rate of updates 0-3 (first fit) and 8-11 (second fit); updates 4-7
# and 12-15 run in plain fits in between (the optimizer's own rate).
def _warmups():
    first = [LearningRateWarmup(warmup_steps=3)]
    second = [LearningRateWarmup(warmup_steps=12, initial_learning_rate=0.01)]
    return (
        first,
        second,
        [expected_warmup(n, 3, 0.0, TARGET, "linear") for n in range(4)],
        [expected_warmup(n, 12, 0.01, TARGET, "linear") for n in range(8, 12)],
    )


def _scalers():
    first = [LearningRateScaler(base_batch_size=BATCH, batch_size=BATCH)]
    second = [LearningRateScaler(base_batch_size=BATCH // 2, batch_size=BATCH)]
    return first, second, [TARGET] * 4, [2 * TARGET] * 4


def _both():
    first = [
        LearningRateScaler(base_batch_size=BATCH, batch_size=BATCH),
        LearningRateWarmup(warmup_steps=2),
    ]
    second = [
        LearningRateScaler(base_batch_size=BATCH // 2, batch_size=BATCH),
        LearningRateWarmup(warmup_steps=16),
    ]
    return (
        first,
        second,
        [expected_warmup(n, 2, 0.0, TARGET, "linear") for n in range(4)],
        [
            expected_warmup(n, 16, 0.0, 2 * TARGET, "linear")
            for n in range(8, 12)
        ],
    )


def _keras_scheduler():
    def make():
        return [keras.callbacks.LearningRateScheduler(lambda epoch: TARGET)]

    return make(), make(), [TARGET] * 4, [TARGET] * 4


CASES = {
    "warmup": _warmups,
    "scaler": _scalers,
    "warmup_and_scaler": _both,
    "keras_scheduler": _keras_scheduler,
}


def check_no_recompile(case: str) -> None:
    """fit(first), fit(plain): traced once each; then fit(second) with new
    callbacks of other numbers and fit(plain) again trace nothing."""
    first, second, rates_first, rates_second = CASES[case]()
    model = _model()
    with count_work() as work:
        _fit(model, first)
        _fit(model, [])
        after_first = work()
        _fit(model, second)
        _fit(model, [])
        added = work() - after_first
    assert added == 0, (
        f"{case}: the second fit with new callbacks, and a plain fit after "
        f"it, added {added} "
        f"{'compilations' if keras.backend.backend() == 'jax' else 'traces'}"
    )
    expected = rates_first + [TARGET] * 4 + rates_second + [TARGET] * 4
    np.testing.assert_allclose(
        model.optimizer.recorded(), expected, rtol=1e-6, atol=1e-9
    )
    # The optimizer is clean again: its own rate, nothing of ours left.
    assert len(model.optimizer.variables) == len(_model_variables(model))


def _model_variables(model) -> list:
    fresh = _model()
    fresh.optimizer.build(fresh.trainable_variables)
    return fresh.optimizer.variables


def check_resume_with_backup(tmp_path, backup_first: bool) -> None:
    """keras_mgpu's BackupAndRestore with a warmup, in either order: a run
    interrupted after epoch 0 resumes exactly (the ramp continues from the
    restored counter), and the backup holds the optimizer as Keras makes
    it (on JAX the ramp's variables are optimizer state during `fit`)."""
    from keras_mgpu.callbacks import BackupAndRestore

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    def run(epochs, extra):
        model = _model()
        backup = BackupAndRestore(str(tmp_path / "backup"))
        warmup = LearningRateWarmup(warmup_steps=6)
        callbacks = [backup, warmup] if backup_first else [warmup, backup]
        rng = np.random.default_rng(0)
        x = rng.normal(size=(STEPS * BATCH, 3)).astype("float32")
        model.fit(
            x,
            x[:, :1],
            batch_size=BATCH,
            epochs=epochs,
            shuffle=False,
            verbose=0,
            callbacks=[*callbacks, *extra],
        )
        return model

    try:
        run(2, [Interrupt()])
    except RuntimeError as error:
        assert "interrupted" in str(error)
    # The backup loads into a plain model, optimizer state included.
    (saved,) = (tmp_path / "backup").glob("*.weights.h5")
    plain = _model()
    plain.optimizer.build(plain.trainable_variables)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plain.load_weights(str(saved))
    assert not [w for w in caught if "Skipping" in str(w.message)]
    assert int(np.asarray(plain.optimizer.iterations.value)) == STEPS
    model = run(2, [])
    expected = [expected_warmup(n, 6, 0.0, TARGET, "linear") for n in range(8)]
    np.testing.assert_allclose(
        model.optimizer.recorded(), expected, rtol=1e-6, atol=1e-9
    )
    assert len(model.optimizer.variables) == len(_model_variables(model))


@pytest.mark.parametrize("case", sorted(CASES))
def test_later_fit_with_new_callbacks_reuses_the_compiled_step(case):
    check_no_recompile(case)


@pytest.mark.parametrize("backup_first", [True, False])
def test_resume_with_backup_and_restore(tmp_path, backup_first):
    check_resume_with_backup(tmp_path, backup_first)

"""Warmup schedule on JAX: closed form, the rate the jitted step uses at
each update (no distribution, DataParallel, ModelParallel), `.keras`
round trip and resume, bad input."""

from __future__ import annotations

import math

import jax
import keras
import numpy as np
import pytest
from callbacks.lr_jax_helpers import (
    RecordingSGD,
    data,
    expected_warmup,
    make_distribution,
    replicas_of,
    scope,
    tiny_model,
)
from keras import ops
from schedules._argument_cases import WARMUP_BAD_INPUT

from keras_mgpu.schedules import Warmup, current_learning_rate

W = 5
INITIAL = 0.01
schedules = keras.optimizers.schedules


def _nested(name):
    return {
        "float": 0.1,
        "cosine_decay": schedules.CosineDecay(0.1, decay_steps=10),
        "piecewise": schedules.PiecewiseConstantDecay(
            [2, 4], [0.1, 0.05, 0.02]
        ),
    }[name]


def closed_form(n, nested, ramp, initial=INITIAL):
    """Warmup(nested, W)(n) written out: the ramp to nested(0), then
    nested shifted by W."""
    value = (lambda t: nested) if isinstance(nested, float) else nested
    if n >= W:
        return float(value(n - W))
    return expected_warmup(n, W, initial, float(value(0)), ramp)


@pytest.mark.parametrize(
    "ramp, nested",
    [
        ("linear", "piecewise"),
        ("exponential", "float"),
        ("cosine", "cosine_decay"),
    ],
)
def test_closed_form_eager_and_jitted(ramp, nested):
    inner = _nested(nested)
    warmup = Warmup(inner, W, initial_learning_rate=INITIAL, ramp=ramp)
    steps = list(range(16))
    expected = [closed_form(n, inner, ramp) for n in steps]
    eager = [float(warmup(n)) for n in steps]
    np.testing.assert_allclose(eager, expected, rtol=1e-6, atol=1e-9)
    traces = []

    @jax.jit
    def evaluate(step):
        traces.append(1)
        return warmup(step)

    jitted = [float(evaluate(np.int32(n))) for n in steps]
    assert len(traces) == 1  # one trace serves every step
    # XLA fuses the decay's cosine differently from eager: 6e-9 apart.
    np.testing.assert_allclose(jitted, expected, rtol=1e-6, atol=1e-8)
    # Hand-over: Warmup(s, W)(W + t) == s(t) exactly.
    for t in (0, 1, 2, 3, 4, 9):
        assert np.float32(warmup(W + t)) == np.float32(expected[W + t])


def _compile(distribution, learning_rate, spe=1, accumulation=None):
    with scope(distribution):
        model = tiny_model()
        optimizer = RecordingSGD(
            learning_rate, gradient_accumulation_steps=accumulation
        )
        model.compile(optimizer=optimizer, loss="mse", steps_per_execution=spe)
    return model, optimizer


def _fit(model, distribution, updates, per_replica=2, epochs=1):
    batch = per_replica * replicas_of(
        "none" if distribution is None else _kind(distribution)
    )
    x, y = data(updates, batch)
    with scope(distribution):
        return model.fit(
            x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=False
        )


def _kind(distribution):
    if isinstance(distribution, keras.distribution.DataParallel):
        return "data_parallel"
    return "model_parallel"


# (distribution, ramp, nested schedule, steps_per_execution)
CASES = [
    ("none", "linear", "float", 4),
    ("data_parallel", "cosine", "piecewise", 1),
    ("model_parallel", "exponential", "cosine_decay", 2),
]


@pytest.mark.parametrize("name, ramp, nested, spe", CASES)
def test_jitted_step_uses_the_closed_form(name, ramp, nested, spe):
    distribution = make_distribution(name)
    inner = _nested(nested)
    lr = Warmup(inner, W, initial_learning_rate=INITIAL, ramp=ramp)
    model, optimizer = _compile(distribution, lr, spe)
    _fit(model, distribution, 12)
    expected = [closed_form(n, inner, ramp) for n in range(12)]
    recorded = optimizer.recorded()
    assert len(recorded) == 12
    assert recorded[0] == pytest.approx(INITIAL, rel=1e-6)
    assert recorded[W] == pytest.approx(float(closed_form(W, inner, ramp)))
    np.testing.assert_allclose(recorded, expected, rtol=1e-5, atol=1e-9)
    if distribution is not None:  # the model really is distributed
        kernel = model.get_layer("hidden").kernel.value
        assert len(kernel.sharding.device_set) == 4


@pytest.mark.keras_limit
def test_keras_builtin_accumulation_feeds_schedules_micro_steps():
    """Keras limit: with `gradient_accumulation_steps=K` Keras evaluates a
    schedule on its micro-step counter (`_iterations`), so a `Warmup`
    compiled into such an optimizer ramps K times too fast, counted in
    updates. keras_mgpu's GradientAccumulationOptimizer and the
    `LearningRateWarmup` callback count updates. Fails once Keras fixes it.
    """
    lr = Warmup(0.1, 8)
    model, optimizer = _compile(None, lr, accumulation=2)
    _fit(model, None, 12)
    recorded = optimizer.recorded()
    assert len(recorded) == 6
    # Update n is applied at micro-step 2n + 1.
    np.testing.assert_allclose(
        recorded, [float(lr(2 * n + 1)) for n in range(6)], rtol=1e-6
    )
    assert recorded[4] == pytest.approx(0.1)  # not 0.1 * 4 / 8


def test_serialization_round_trip():
    warmup = Warmup(
        schedules.PiecewiseConstantDecay([3, 6], [0.4, 0.2, 0.1]),
        W,
        initial_learning_rate=0.02,
        ramp="exponential",
    )
    config = schedules.serialize(warmup)
    restored = schedules.deserialize(config)
    assert isinstance(restored, Warmup)
    assert restored.get_config() == warmup.get_config()
    assert restored.get_config()["flavour"] == "keras3"
    for step in (0, 3, W - 1, W, W + 4, W + 9):
        assert float(restored(step)) == float(warmup(step))


def test_keras_file_round_trip_and_resume(tmp_path):
    """Saved mid-warmup under DataParallel, loaded, trained on: the ramp
    continues at the restored update count."""
    distribution = make_distribution("data_parallel")
    nested = schedules.CosineDecay(0.1, decay_steps=10)
    lr = Warmup(nested, W, ramp="cosine")
    model, _ = _compile(distribution, lr)
    _fit(model, distribution, 3)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with distribution.scope():
        loaded = keras.models.load_model(path)
    restored = loaded.optimizer._learning_rate
    assert isinstance(restored, Warmup)
    assert restored.get_config() == lr.get_config()
    assert int(ops.convert_to_numpy(loaded.optimizer.iterations)) == 3
    assert current_learning_rate(loaded.optimizer) == pytest.approx(
        closed_form(3, nested, "cosine", initial=0.0)
    )
    _fit(loaded, distribution, 6)
    expected = [closed_form(n, nested, "cosine", 0.0) for n in range(9)]
    np.testing.assert_allclose(
        loaded.optimizer.recorded(), expected, rtol=1e-5, atol=1e-9
    )


@pytest.mark.parametrize("kwargs, error, match", WARMUP_BAD_INPUT)
def test_bad_input(kwargs, error, match):
    arguments = {"schedule": 0.1, "warmup_steps": 4, **kwargs}
    with pytest.raises(error, match=match):
        Warmup(**arguments)


class _VectorSchedule(schedules.LearningRateSchedule):
    def __call__(self, step):
        return ops.ones((2,)) * 0.1


class _IntSchedule(schedules.LearningRateSchedule):
    def __call__(self, step):
        return ops.convert_to_tensor(1, "int32")


class _BrokenSchedule(schedules.LearningRateSchedule):
    def __call__(self, step):
        raise RuntimeError("boom")


@pytest.mark.parametrize(
    "schedule, match",
    [
        (_VectorSchedule(), r"scalar float.*dtype=float32, shape=\[2\]"),
        (_IntSchedule(), r"scalar float.*dtype=int32, shape=\[\]"),
        (_BrokenSchedule(), r"scalar float.*raised RuntimeError: boom"),
    ],
)
def test_schedule_must_return_scalar_float(schedule, match):
    with pytest.raises(ValueError, match=match):
        Warmup(schedule, 4)


def test_math_is_exact_in_float32():
    """No TensorFlow on this path: the value is a JAX array."""
    value = Warmup(0.1, 4)(2)
    assert isinstance(value, jax.Array)
    assert value.dtype == np.float32
    assert float(value) == pytest.approx(0.05, rel=1e-7)
    assert math.isclose(float(Warmup(0.1, 4)(4)), np.float32(0.1))

"""Warmup schedule: closed form at the boundaries, offset hand-over,
in-graph evaluation, serialization and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from schedules._argument_cases import WARMUP_BAD_INPUT

from keras_mgpu._flavour import keras, tf
from keras_mgpu.schedules import Warmup

W = 8
INITIAL = 0.01
schedules = keras.optimizers.schedules


def closed_form(step, start, ramp, initial=INITIAL, warmup=W):
    """The warmup value for `step < warmup`, written out by hand."""
    fraction = step / warmup
    if ramp == "linear":
        return initial + (start - initial) * fraction
    if ramp == "cosine":
        return initial + (start - initial) * 0.5 * (
            1 - math.cos(math.pi * fraction)
        )
    return initial * (start / initial) ** fraction


def _nested():
    return {
        "float": 0.4,
        "cosine_decay": schedules.CosineDecay(0.4, decay_steps=20),
        "piecewise": schedules.PiecewiseConstantDecay([3, 6], [0.4, 0.2, 0.1]),
    }


@pytest.mark.parametrize("ramp", ["linear", "exponential", "cosine"])
@pytest.mark.parametrize("nested", ["float", "cosine_decay", "piecewise"])
def test_closed_form_at_boundaries(ramp, nested):
    inner = _nested()[nested]
    s = inner if callable(inner) else (lambda step: inner)
    warmup = Warmup(inner, W, initial_learning_rate=INITIAL, ramp=ramp)
    start = float(s(0))
    # step 0, inside, last warmup step, first post-warmup step, and after.
    for step in (0, 1, W // 2, W - 1):
        expected = closed_form(step, start, ramp)
        np.testing.assert_allclose(
            float(warmup(step)), expected, rtol=1e-6, atol=1e-9
        )
    assert float(warmup(0)) == pytest.approx(INITIAL, rel=1e-6)
    # Hand-over: Warmup(s, W)(W + t) == s(t), exactly.
    for t in (0, 1, 2, 3, 4, 6, 7, 15, 40):
        assert np.float32(warmup(W + t)) == np.float32(s(t))


def test_integer_and_float_steps_and_variable():
    warmup = Warmup(schedules.PiecewiseConstantDecay([3], [0.4, 0.1]), 4)
    step = tf.Variable(8, dtype=tf.int64)
    assert float(warmup(step)) == pytest.approx(0.1)  # own step 4 > boundary 3
    assert float(warmup(6)) == pytest.approx(0.4)
    assert float(warmup(tf.constant(2.0))) == pytest.approx(0.2)


def test_in_graph_no_retrace_per_step():
    warmup = Warmup(schedules.CosineDecay(0.4, 20), W, ramp="cosine")
    traces = []

    @tf.function
    def evaluate(step):
        traces.append(1)
        return warmup(step)

    step = tf.Variable(0, dtype=tf.int64)
    values = []
    for _ in range(12):
        values.append(float(evaluate(step)))
        step.assign_add(1)
    assert len(traces) == 1
    np.testing.assert_allclose(
        values, [float(warmup(i)) for i in range(12)], rtol=1e-7
    )


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
    for step in (0, 3, W - 1, W, W + 4, W + 9):
        assert float(restored(step)) == float(warmup(step))


@pytest.mark.parametrize("strategy_name", ["default", "mirrored_2"])
def test_keras_file_round_trip(tmp_path, strategy_name):
    from conftest import make_strategy

    with make_strategy(strategy_name).scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        lr = Warmup(schedules.CosineDecay(0.1, 50), warmup_steps=5)
        model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    x = np.ones((16, 3), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    restored = loaded.optimizer._learning_rate
    assert isinstance(restored, Warmup)
    assert restored.get_config() == lr.get_config()
    assert int(loaded.optimizer.iterations.numpy()) == 4
    assert float(loaded.optimizer.learning_rate) == pytest.approx(float(lr(4)))


@pytest.mark.parametrize("kwargs, error, match", WARMUP_BAD_INPUT)
def test_bad_input(kwargs, error, match):
    arguments = {"schedule": 0.1, "warmup_steps": 4, **kwargs}
    with pytest.raises(error, match=match):
        Warmup(**arguments)


class _VectorSchedule(schedules.LearningRateSchedule):
    def __call__(self, step):
        return tf.ones((2,)) * 0.1


class _IntSchedule(schedules.LearningRateSchedule):
    def __call__(self, step):
        return tf.constant(1, tf.int32)


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

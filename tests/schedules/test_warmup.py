"""Warmup schedule on each backend: closed form at the boundaries, offset
hand-over, compiled evaluation (one trace serves every step), the rate the
compiled train step uses at each update, serialization, `.keras` round trip
and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from keras_mgpu._flavour import keras
from keras_mgpu.schedules import Warmup, current_learning_rate

pytestmark = pytest.mark.backends("tensorflow", "jax")

ON_JAX = keras.backend.backend() == "jax"
W = 8
INITIAL = 0.01
schedules = keras.optimizers.schedules
ops = keras.ops

# (kwargs, error, match) for `Warmup`.
WARMUP_BAD_INPUT = [
    (
        {"warmup_steps": 0},
        ValueError,
        r"Argument `warmup_steps` must be an integer >= 1\. "
        r"Received: warmup_steps=0",
    ),
    (
        {"warmup_steps": -3},
        ValueError,
        r"Received: warmup_steps=-3",
    ),
    (
        {"warmup_steps": 2.5},
        TypeError,
        r"`warmup_steps` must be an integer >= 1",
    ),
    (
        {"ramp": "quadratic"},
        ValueError,
        r"Argument `ramp` must be one of 'linear', 'exponential', "
        r"'cosine'\. Received: ramp='quadratic'",
    ),
    (
        {"ramp": "exponential"},
        ValueError,
        r"`initial_learning_rate` must be > 0 with ramp='exponential'",
    ),
    (
        {"initial_learning_rate": -1.0},
        ValueError,
        r"`initial_learning_rate` must be a number >= 0\.0",
    ),
    (
        {"schedule": "0.1"},
        TypeError,
        r"Argument `schedule` must be a float or a .*LearningRateSchedule"
        r".*Received: schedule='0\.1'",
    ),
    (
        {"schedule": -0.5},
        ValueError,
        r"Argument `schedule` must be a number >= 0\.0",
    ),
]


def ramp_value(step, start, ramp, initial=INITIAL, warmup=W):
    """The warmup value for `step < warmup`, written out by hand."""
    fraction = step / warmup
    if ramp == "linear":
        return initial + (start - initial) * fraction
    if ramp == "cosine":
        return initial + (start - initial) * 0.5 * (
            1 - math.cos(math.pi * fraction)
        )
    return initial * (start / initial) ** fraction


def closed_form(step, nested, ramp, initial=INITIAL, warmup=W):
    """Warmup(nested, warmup)(step) written out: the ramp to nested(0),
    then nested shifted by `warmup`."""
    value = nested if callable(nested) else (lambda t: nested)
    if step >= warmup:
        return float(value(step - warmup))
    return ramp_value(step, float(value(0)), ramp, initial, warmup)


def _nested(name):
    return {
        "float": 0.4,
        "cosine_decay": schedules.CosineDecay(0.4, decay_steps=20),
        "piecewise": schedules.PiecewiseConstantDecay([3, 6], [0.4, 0.2, 0.1]),
    }[name]


@pytest.mark.parametrize("ramp", ["linear", "exponential", "cosine"])
@pytest.mark.parametrize("nested", ["float", "cosine_decay", "piecewise"])
def test_closed_form_at_boundaries(ramp, nested):
    inner = _nested(nested)
    s = inner if callable(inner) else (lambda step: inner)
    warmup = Warmup(inner, W, initial_learning_rate=INITIAL, ramp=ramp)
    start = float(s(0))
    # step 0, inside, last warmup step, first post-warmup step, and after.
    for step in (0, 1, W // 2, W - 1):
        expected = ramp_value(step, start, ramp)
        np.testing.assert_allclose(
            float(warmup(step)), expected, rtol=1e-6, atol=1e-9
        )
    assert float(warmup(0)) == pytest.approx(INITIAL, rel=1e-6)
    # Hand-over: Warmup(s, W)(W + t) == s(t), exactly.
    for t in (0, 1, 2, 3, 4, 6, 7, 15, 40):
        assert np.float32(warmup(W + t)) == np.float32(s(t))


def test_integer_and_float_steps_and_variable():
    warmup = Warmup(schedules.PiecewiseConstantDecay([3], [0.4, 0.1]), 4)
    # int64 as TensorFlow's `iterations` (JAX without x64 has no int64).
    dtype = "int32" if ON_JAX else "int64"
    step = keras.Variable(8, dtype=dtype, trainable=False)
    assert float(warmup(step)) == pytest.approx(0.1)  # own step 4 > boundary 3
    assert float(warmup(6)) == pytest.approx(0.4)
    assert float(warmup(ops.convert_to_tensor(2.0))) == pytest.approx(0.2)


def _compiled(function):
    """(call(step), traces): `function` compiled the backend's way
    (`jax.jit` on an int32 step; `tf.function` on an int64 variable, as a
    TensorFlow train step reads `iterations`), and its trace count."""
    traces = []

    def traced(step):
        traces.append(1)
        return function(step)

    if ON_JAX:
        import jax

        jitted = jax.jit(traced)
        return (lambda n: jitted(np.int32(n))), traces
    import tensorflow as tf

    graph = tf.function(traced)
    variable = tf.Variable(0, dtype=tf.int64)

    def call(n):
        variable.assign(n)
        return graph(variable)

    return call, traces


@pytest.mark.parametrize(
    "ramp, nested",
    [
        ("linear", "piecewise"),
        ("exponential", "float"),
        ("cosine", "cosine_decay"),
    ],
)
def test_compiled_once_equals_the_closed_form(ramp, nested):
    inner = _nested(nested)
    warmup = Warmup(inner, W, initial_learning_rate=INITIAL, ramp=ramp)
    steps = range(2 * W)
    expected = [closed_form(n, inner, ramp) for n in steps]
    evaluate, traces = _compiled(warmup)
    compiled = [float(evaluate(n)) for n in steps]
    assert len(traces) == 1  # one trace serves every step
    # XLA fuses the decay's cosine differently from eager: 6e-9 apart.
    np.testing.assert_allclose(compiled, expected, rtol=1e-6, atol=1e-8)


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


@pytest.mark.parametrize(
    "strategy_name",
    [
        pytest.param("default"),
        pytest.param("mirrored_2", marks=pytest.mark.backends("tensorflow")),
        pytest.param("data_parallel_4", marks=pytest.mark.backends("jax")),
    ],
)
def test_keras_file_round_trip(tmp_path, strategy_name):
    from keras_mgpu.testing import make_strategy

    strategy = make_strategy(strategy_name)
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        lr = Warmup(schedules.CosineDecay(0.1, 50), warmup_steps=5)
        model.compile(optimizer=keras.optimizers.SGD(lr), loss="mse")
    x = np.ones((16, 3), "float32")
    model.fit(x, x[:, :1], batch_size=4, epochs=1, verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    restored = loaded.optimizer._learning_rate
    assert isinstance(restored, Warmup)
    assert restored.get_config() == lr.get_config()
    assert int(ops.convert_to_numpy(loaded.optimizer.iterations)) == 4
    assert current_learning_rate(loaded.optimizer) == pytest.approx(
        float(lr(4))
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


# ----------------------------------------------------------------------
# JAX: the rate the jitted train step uses at each update, under no
# distribution, DataParallel and ModelParallel (read inside the step by
# `RecordingSGD`), and a resume mid-warmup.
# ----------------------------------------------------------------------
def _jax_helpers():
    from callbacks import lr_jax_helpers

    return lr_jax_helpers


def _compile(distribution, learning_rate, spe=1, accumulation=None):
    h = _jax_helpers()
    with h.scope(distribution):
        model = h.tiny_model()
        optimizer = h.RecordingSGD(
            learning_rate, gradient_accumulation_steps=accumulation
        )
        model.compile(optimizer=optimizer, loss="mse", steps_per_execution=spe)
    return model, optimizer


def _fit(model, name, updates, per_replica=2):
    h = _jax_helpers()
    batch = per_replica * h.replicas_of(name)
    x, y = h.data(updates, batch)
    with h.scope(h.make_distribution(name)):
        return model.fit(x, y, batch_size=batch, verbose=0, shuffle=False)


@pytest.mark.backends("jax")
@pytest.mark.parametrize(
    "name, ramp, nested, spe",
    [
        ("none", "linear", "float", 4),
        ("data_parallel", "cosine", "piecewise", 1),
        ("model_parallel", "exponential", "cosine_decay", 2),
    ],
)
def test_jitted_step_uses_the_closed_form(name, ramp, nested, spe):
    distribution = _jax_helpers().make_distribution(name)
    inner = _nested(nested)
    lr = Warmup(inner, W, initial_learning_rate=INITIAL, ramp=ramp)
    model, optimizer = _compile(distribution, lr, spe)
    _fit(model, name, 12)
    expected = [closed_form(n, inner, ramp) for n in range(12)]
    recorded = optimizer.recorded()
    assert len(recorded) == 12
    assert recorded[0] == pytest.approx(INITIAL, rel=1e-6)
    assert recorded[W] == pytest.approx(float(closed_form(W, inner, ramp)))
    np.testing.assert_allclose(recorded, expected, rtol=1e-5, atol=1e-9)
    if distribution is not None:  # the model really is distributed
        kernel = model.get_layer("hidden").kernel.value
        assert len(kernel.sharding.device_set) == 4


@pytest.mark.backends("jax")
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
    _fit(model, "none", 12)
    recorded = optimizer.recorded()
    assert len(recorded) == 6
    # Update n is applied at micro-step 2n + 1.
    np.testing.assert_allclose(
        recorded, [float(lr(2 * n + 1)) for n in range(6)], rtol=1e-6
    )
    assert recorded[4] == pytest.approx(0.1)  # not 0.1 * 4 / 8


@pytest.mark.backends("jax")
def test_jitted_steps_resume_mid_warmup_from_a_keras_file(tmp_path):
    """Saved mid-warmup under DataParallel, loaded, trained on: the ramp
    continues at the restored update count, read inside each step."""
    distribution = _jax_helpers().make_distribution("data_parallel")
    nested = schedules.CosineDecay(0.1, decay_steps=10)
    lr = Warmup(nested, W, ramp="cosine")
    model, _ = _compile(distribution, lr)
    _fit(model, "data_parallel", 3)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with distribution.scope():
        loaded = keras.models.load_model(path)
    assert int(ops.convert_to_numpy(loaded.optimizer.iterations)) == 3
    assert current_learning_rate(loaded.optimizer) == pytest.approx(
        closed_form(3, nested, "cosine", initial=0.0)
    )
    _fit(loaded, "data_parallel", 6)
    expected = [closed_form(n, nested, "cosine", 0.0) for n in range(9)]
    np.testing.assert_allclose(
        loaded.optimizer.recorded(), expected, rtol=1e-5, atol=1e-9
    )


@pytest.mark.backends("jax")
def test_math_is_exact_in_float32():
    """No TensorFlow on this path: the value is a JAX array."""
    import jax

    value = Warmup(0.1, 4)(2)
    assert isinstance(value, jax.Array)
    assert value.dtype == np.float32
    assert float(value) == pytest.approx(0.05, rel=1e-7)
    assert math.isclose(float(Warmup(0.1, 4)(4)), np.float32(0.1))

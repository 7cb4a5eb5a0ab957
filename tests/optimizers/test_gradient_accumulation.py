"""GradientAccumulationOptimizer: exact large-batch equivalence and
semantics, on each backend.

Reference for every comparison: the plain inner optimizer on one device
(default strategy) with a batch `accumulation_steps × global micro-batch`,
same initial weights, same sample order. The strategy matrix is the
backend's (`tf.distribute` strategies on TensorFlow, `keras.distribution`
on JAX). JAX-only tests (custom stateless loops, compiled HLO, Keras's
limits on JAX, resume under a distribution) come last.
"""

from __future__ import annotations

import numpy as np
import pytest
from _training import assert_weights_close, mlp, regression_data

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras
from keras_mgpu.normalization import BatchNormMicroBatchWarning
from keras_mgpu.testing import make_strategy
from keras_mgpu.testing.strategies import STRATEGY_NAMES

pytestmark = pytest.mark.backends("tensorflow", "jax")

ON_JAX = keras.backend.backend() == "jax"
ops = keras.ops


def _int(value) -> int:
    return int(ops.convert_to_numpy(value))


ACCUMULATION = 3
MICRO_BATCH = 8  # global micro-batch (split across replicas)
UPDATES = 12
SAMPLES = ACCUMULATION * MICRO_BATCH * UPDATES


def _optimizers():
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 4, 0.5)
    table = {
        "sgd": lambda: keras.optimizers.SGD(0.1),
        "momentum": lambda: keras.optimizers.SGD(0.05, momentum=0.9),
        "nesterov": lambda: keras.optimizers.SGD(
            0.05, momentum=0.9, nesterov=True
        ),
        "adam": lambda: keras.optimizers.Adam(0.01),
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.2),
        "rmsprop": lambda: keras.optimizers.RMSprop(0.005),
        "adafactor": lambda: keras.optimizers.Adafactor(0.05),
        "lion": lambda: keras.optimizers.Lion(0.002),
        "schedule_ema": lambda: keras.optimizers.SGD(
            schedule, use_ema=True, ema_momentum=0.5
        ),
        "clipnorm": lambda: keras.optimizers.SGD(0.2, clipnorm=0.05),
        "global_clipnorm": lambda: keras.optimizers.SGD(
            0.2, global_clipnorm=0.05
        ),
        "clipvalue": lambda: keras.optimizers.SGD(0.2, clipvalue=0.01),
    }
    return table


OPTIMIZERS = _optimizers()
# The whole optimizer table runs on one device and on 2 mirrored replicas;
# the rest of the strategy matrix runs the cases that exercise every code
# path (stateful optimizer, weight decay, clipping on the reduced mean).
MATRIX_OPTIMIZERS = ("momentum", "adamw", "global_clipnorm")
# TensorFlow: the whole `tf.distribute` matrix. JAX: no distribution,
# DataParallel on the 4 devices and a 2x2 ModelParallel mesh (the other
# DataParallel sizes add compile time, not paths).
MATRIX = (
    ("default", "data_parallel_4", "model_parallel_2x2")
    if ON_JAX
    else STRATEGY_NAMES
)

_reference_cache: dict = {}


def _train(strategy, optimizer_name, accumulation, batch_size, **compile_kw):
    x, y = regression_data(SAMPLES)
    with strategy.scope():
        model = mlp()
        optimizer = OPTIMIZERS[optimizer_name]()
        if accumulation:
            optimizer = GradientAccumulationOptimizer(optimizer, accumulation)
        model.compile(optimizer=optimizer, loss="mse", **compile_kw)
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    if getattr(optimizer, "use_ema", False) or getattr(
        getattr(optimizer, "inner_optimizer", None), "use_ema", False
    ):
        optimizer.finalize_variable_values(model.trainable_variables)
    return model


def _reference(optimizer_name):
    if optimizer_name not in _reference_cache:
        model = _train(
            make_strategy("default"),
            optimizer_name,
            accumulation=None,
            batch_size=ACCUMULATION * MICRO_BATCH,
        )
        _reference_cache[optimizer_name] = model.get_weights()
        keras.backend.clear_session()
    return _reference_cache[optimizer_name]


def _check_against_reference(strategy, optimizer_name, **compile_kw):
    expected = _reference(optimizer_name)
    model = _train(
        strategy, optimizer_name, ACCUMULATION, MICRO_BATCH, **compile_kw
    )
    assert_weights_close(model.get_weights(), expected)
    optimizer = model.optimizer
    assert _int(optimizer.iterations) == UPDATES
    assert _int(optimizer.micro_steps) == UPDATES * ACCUMULATION
    assert _int(optimizer.pending_steps) == 0
    if ON_JAX:
        # Accumulators take their variable's layout (sharded under
        # ModelParallel, replicated under DataParallel).
        for variable, accumulator in zip(
            model.trainable_variables, optimizer.accumulators
        ):
            assert accumulator.value.sharding == variable.value.sharding


@pytest.mark.parametrize("optimizer_name", MATRIX_OPTIMIZERS)
@pytest.mark.parametrize("strategy_name", MATRIX)
def test_matches_large_batch_under_every_strategy(
    strategy_name, optimizer_name
):
    _check_against_reference(make_strategy(strategy_name), optimizer_name)


# TensorFlow only: on JAX the optimizers' update rules are Keras's same
# code, and each fit costs a compilation; JAX's matrix runs three of them.
@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize(
    "optimizer_name",
    [name for name in OPTIMIZERS if name not in MATRIX_OPTIMIZERS],
)
def test_matches_large_batch_for_every_optimizer(optimizer_name):
    _check_against_reference(make_strategy("mirrored_2"), optimizer_name)


# TensorFlow only: JAX computes in float32 unless x64 is enabled at start.
@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("strategy_name", ["default", "mirrored_2"])
def test_float64_matches_large_batch_tightly(strategy_name):
    keras.backend.set_floatx("float64")
    try:
        x, y = regression_data(SAMPLES)
        x, y = x.astype("float64"), y.astype("float64")

        def train(strategy, accumulation, batch):
            with strategy.scope():
                model = mlp()
                optimizer = keras.optimizers.Adam(0.01)
                if accumulation:
                    optimizer = GradientAccumulationOptimizer(
                        optimizer, accumulation
                    )
                model.compile(optimizer=optimizer, loss="mse")
            model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
            return model.get_weights()

        expected = train(
            make_strategy("default"), None, ACCUMULATION * MICRO_BATCH
        )
        actual = train(make_strategy(strategy_name), ACCUMULATION, MICRO_BATCH)
        assert actual[0].dtype == np.float64
        assert_weights_close(actual, expected, rtol=1e-10, atol=1e-12)
    finally:
        keras.backend.set_floatx("float32")


# TensorFlow's `tf.function` loop and XLA (JAX: test_accumulation_execution
# and the jitted tests below).
@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("strategy_name", ["default", "one_device"])
@pytest.mark.parametrize(
    "compile_kw",
    [{"steps_per_execution": 4}, {"jit_compile": True}],
    ids=["steps_per_execution_4", "jit_compile"],
)
def test_steps_per_execution_and_jit_compile(strategy_name, compile_kw):
    _check_against_reference(
        make_strategy(strategy_name), "momentum", **compile_kw
    )


@pytest.mark.backends("tensorflow")
def test_steps_per_execution_under_mirrored_works_with_the_wrapper():
    # Plain Keras 3.15 fails here (tests/test_keras_limits.py); with the
    # wrapper the update runs in cross-replica context and succeeds.
    _check_against_reference(
        make_strategy("mirrored_2"), "momentum", steps_per_execution=4
    )


@pytest.mark.backends("tensorflow")
def test_jit_compile_under_mirrored_on_cpu_raises_clearly():
    strategy = make_strategy("mirrored_2")
    with pytest.raises(ValueError, match="jit_compile=True under Mirrored"):
        _train(strategy, "sgd", ACCUMULATION, MICRO_BATCH, jit_compile=True)


def test_counters_and_pending_steps_mid_window():
    x, y = regression_data(5 * 4)
    model = mlp()
    optimizer = GradientAccumulationOptimizer(keras.optimizers.SGD(0.1), 4)
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0)
    assert int(optimizer.micro_steps.numpy()) == 5
    assert int(optimizer.iterations.numpy()) == 1
    assert int(optimizer.pending_steps.numpy()) == 1
    assert optimizer.iterations is optimizer.inner_optimizer.iterations
    # The accumulators hold exactly the one pending micro-batch's gradient.
    assert any(np.any(a.numpy() != 0) for a in optimizer.accumulators)


def test_learning_rate_schedule_advances_per_update_not_per_micro_step():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay(
        [2], [0.1, 0.01]
    )
    inner = keras.optimizers.SGD(schedule)
    optimizer = GradientAccumulationOptimizer(inner, 4)
    x, y = regression_data(4 * 3 * 2)
    model = mlp()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(x, y, batch_size=2, shuffle=False, verbose=0)
    # 12 micro-steps = 3 updates: the schedule saw steps 0, 1, 2.
    assert int(optimizer.iterations.numpy()) == 3
    assert float(ops.convert_to_numpy(optimizer.learning_rate)) == (
        pytest.approx(0.01)
    )


def test_learning_rate_passthrough_setter():
    inner = keras.optimizers.SGD(0.1)
    optimizer = GradientAccumulationOptimizer(inner, 2)
    optimizer.learning_rate = 0.5
    assert float(inner.learning_rate.numpy()) == pytest.approx(0.5)


def _embedding_model():
    keras.utils.set_random_seed(5)
    return keras.Sequential(
        [
            keras.Input((5,), dtype="int32"),
            keras.layers.Embedding(50, 4),
            keras.layers.Flatten(),
            keras.layers.Dense(1),
        ]
    )


def _embedding_data():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 50, size=(96, 5)).astype("int32")
    y = rng.normal(size=(96, 1)).astype("float32")
    return ids, y


def _fit_embedding(optimizer, batch):
    ids, y = _embedding_data()
    model = _embedding_model()
    model.compile(optimizer=optimizer, loss="mse")
    model.fit(ids, y, batch_size=batch, shuffle=False, verbose=0)
    return model.get_weights()


# TensorFlow only: Keras's sparse gradients (IndexedSlices); JAX's are
# dense.
@pytest.mark.backends("tensorflow")
def test_sparse_embedding_gradients_match_large_batch():
    # SGD with momentum is linear in the gradient, so Keras's sparse path
    # (IndexedSlices with repeated rows) and our dense accumulators agree.
    def sgd():
        return keras.optimizers.SGD(0.05, momentum=0.9)

    expected = _fit_embedding(sgd(), 24)
    actual = _fit_embedding(GradientAccumulationOptimizer(sgd(), 4), 6)
    assert_weights_close(actual, expected)


@pytest.mark.backends("tensorflow")
def test_sparse_gradients_with_adam_match_dense_large_batch():
    # Adam squares the gradient. Keras 3.15 squares each IndexedSlices row
    # separately, repeated rows included, so its own sparse large batch is
    # not the dense-gradient Adam step. The wrapper accumulates densely and
    # matches the large batch computed with dense gradients.
    import tensorflow as tf

    ids, y = _embedding_data()
    model = _embedding_model()
    inner = keras.optimizers.Adam(0.05)
    loss_fn = keras.losses.MeanSquaredError()
    for start in range(0, 96, 24):
        with tf.GradientTape() as tape:
            pred = model(ids[start : start + 24], training=True)
            loss = loss_fn(y[start : start + 24], pred)
        grads = tape.gradient(loss, model.trainable_variables)
        grads = [tf.convert_to_tensor(g) for g in grads]
        inner.apply(grads, model.trainable_variables)
    expected = model.get_weights()
    actual = _fit_embedding(
        GradientAccumulationOptimizer(keras.optimizers.Adam(0.05), 4), 6
    )
    assert_weights_close(actual, expected)


class _PartlyUsed(keras.layers.Layer):
    """A layer with a weight that never reaches the loss (no gradient)."""

    def build(self, input_shape):
        self.used = self.add_weight(shape=(input_shape[-1], 1), name="used")
        self.unused = self.add_weight(shape=(3,), name="unused")

    def call(self, x):
        return x @ self.used


# TensorFlow only: Keras's JAX trainer differentiates every trainable
# variable (a zero gradient, no warning); JAX's eager `apply` with a missing
# gradient: test_eager_apply_and_missing_gradients.
@pytest.mark.backends("tensorflow")
def test_variables_without_gradient_are_left_alone():
    x, y = regression_data(48)

    def train(accumulation, batch):
        keras.utils.set_random_seed(9)
        model = keras.Sequential([keras.Input((6,)), _PartlyUsed()])
        optimizer = keras.optimizers.SGD(0.1, momentum=0.5)
        if accumulation:
            optimizer = GradientAccumulationOptimizer(optimizer, accumulation)
        model.compile(optimizer=optimizer, loss="mse")
        initial = model.get_weights()
        with pytest.warns(UserWarning, match="Gradients do not exist"):
            model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        return initial, model.get_weights()

    initial, plain = train(None, 12)
    initial_acc, accumulated = train(4, 3)
    assert_weights_close(accumulated, plain)
    np.testing.assert_array_equal(accumulated[1], initial_acc[1])


def test_batch_normalization_trains_and_updates_moving_stats_per_micro_batch():
    # BatchNormalization statistics are not optimizer state: they move on
    # every training forward pass, i.e. once per micro-batch (documented).
    x, y = regression_data(32)
    keras.utils.set_random_seed(2)
    bn = keras.layers.BatchNormalization(momentum=0.5)
    model = keras.Sequential([keras.Input((6,)), bn, keras.layers.Dense(1)])
    model.compile(
        optimizer=GradientAccumulationOptimizer(keras.optimizers.SGD(0.1), 4),
        loss="mse",
    )
    with pytest.warns(BatchNormMicroBatchWarning):
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    # Closed form of 4 momentum updates with micro-batch means.
    expected = np.zeros(6, "float32")
    for start in range(0, 32, 8):
        expected = 0.5 * expected + 0.5 * x[start : start + 8].mean(axis=0)
    np.testing.assert_allclose(bn.moving_mean.numpy(), expected, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == 1
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


def test_nonfinite_window_is_skipped_and_accumulators_restart():
    v = keras.Variable(np.zeros(2, "float32"))
    optimizer = GradientAccumulationOptimizer(keras.optimizers.SGD(1.0), 2)
    optimizer.apply([np.array([np.nan, 1.0], "float32")], [v])
    optimizer.apply([np.array([1.0, 1.0], "float32")], [v])
    np.testing.assert_array_equal(v.numpy(), [0.0, 0.0])
    assert int(optimizer.skipped_updates.numpy()) == 1
    assert int(optimizer.iterations.numpy()) == 0
    optimizer.apply([np.array([2.0, 2.0], "float32")], [v])
    optimizer.apply([np.array([4.0, 4.0], "float32")], [v])
    np.testing.assert_allclose(v.numpy(), [-3.0, -3.0])
    assert int(optimizer.iterations.numpy()) == 1


def test_inner_loss_scale_factor_is_applied_once():
    x, y = regression_data(48)

    def train(inner, accumulation, batch):
        model = mlp()
        optimizer = inner
        if accumulation:
            optimizer = GradientAccumulationOptimizer(inner, accumulation)
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        return model.get_weights()

    expected = train(keras.optimizers.SGD(0.1), None, 12)
    actual = train(keras.optimizers.SGD(0.1, loss_scale_factor=128.0), 3, 4)
    assert_weights_close(actual, expected)


# ----------------------------------------------------------------------
# Bad input
# ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "steps, error, message",
    [
        (
            0,
            ValueError,
            r"`accumulation_steps` must be an integer >= 1\. "
            r"Received: accumulation_steps=0",
        ),
        (-2, ValueError, r"Received: accumulation_steps=-2"),
        (2.0, TypeError, r"Received: accumulation_steps=2\.0 \(of type float"),
        (True, TypeError, r"Received: accumulation_steps=True \(of type bool"),
        (None, TypeError, r"Received: accumulation_steps=None"),
        ("4", TypeError, r"Received: accumulation_steps='4'"),
    ],
)
def test_bad_accumulation_steps(steps, error, message):
    with pytest.raises(error, match=message):
        GradientAccumulationOptimizer(keras.optimizers.SGD(), steps)


@pytest.mark.backends("tensorflow")
def test_rejects_legacy_tf_optimizer():
    import tensorflow as tf

    with pytest.raises(TypeError, match=r"`inner_optimizer`"):
        GradientAccumulationOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(0.1), 2
        )


def test_rejects_non_optimizer():
    with pytest.raises(TypeError, match=r"Received: inner_optimizer='sgd'"):
        GradientAccumulationOptimizer("sgd", 2)


def test_rejects_wrapping_twice():
    once = GradientAccumulationOptimizer(keras.optimizers.SGD(), 2)
    with pytest.raises(ValueError, match="already a GradientAccumulation"):
        GradientAccumulationOptimizer(once, 2)


def test_rejects_builtin_accumulation_on_inner():
    inner = keras.optimizers.SGD(gradient_accumulation_steps=4)
    with pytest.raises(ValueError, match="own gradient_accumulation_steps=4"):
        GradientAccumulationOptimizer(inner, 2)


def test_rejects_loss_scale_optimizer_inside():
    inner = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match="Put loss scaling outside"):
        GradientAccumulationOptimizer(inner, 2)


@pytest.mark.parametrize(
    "argument", ["clipnorm", "global_clipnorm", "learning_rate", "use_ema"]
)
def test_rejects_base_arguments_meant_for_inner(argument):
    with pytest.raises(ValueError, match=f"Set `{argument}` on the"):
        GradientAccumulationOptimizer(
            keras.optimizers.SGD(), 2, **{argument: 1.0}
        )


def test_config_round_trip():
    inner = keras.optimizers.AdamW(0.003, weight_decay=0.01, clipnorm=1.0)
    optimizer = GradientAccumulationOptimizer(inner, 5, name="acc")
    config = optimizer.get_config()
    restored = GradientAccumulationOptimizer.from_config(config)
    assert restored.accumulation_steps == 5
    assert restored.name == "acc"
    assert isinstance(restored.inner_optimizer, keras.optimizers.AdamW)
    assert restored.inner_optimizer.get_config() == inner.get_config()
    assert config["compression"] is None
    assert not config["momentum_correction"]
    # Registered: generic deserialization finds the class by name.
    generic = keras.optimizers.deserialize(
        keras.optimizers.serialize(optimizer)
    )
    assert isinstance(generic, GradientAccumulationOptimizer)
    assert generic.get_config() == config
    # A schedule as the inner rate survives Keras's object serialization.
    scheduled = GradientAccumulationOptimizer(
        keras.optimizers.AdamW(
            keras.optimizers.schedules.PiecewiseConstantDecay([0], [0.1, 0.01]),
            weight_decay=0.1,
        ),
        3,
    )
    restored = keras.saving.deserialize_keras_object(
        keras.saving.serialize_keras_object(scheduled)
    )
    assert isinstance(restored, GradientAccumulationOptimizer)
    assert isinstance(restored.inner_optimizer, keras.optimizers.AdamW)
    assert restored.get_config() == scheduled.get_config()


# ======================================================================
# JAX (`keras.distribution`): the plain computation is one eager `apply`
# of the inner optimizer per large batch, its gradient from `jax.grad`.
# ======================================================================
STEPS = 2  # accumulation steps
MICRO = 16  # global micro-batch (over every device)
LARGE = STEPS * MICRO
TOLERANCE = 2e-6  # max abs weight difference (measured 3e-8 to 6e-8)

RNG = np.random.default_rng(7)
X = RNG.normal(size=(4 * MICRO, 6)).astype("float32")
Y = RNG.normal(size=(4 * MICRO, 4)).astype("float32")


def _schedule():
    # The rate changes after the first update: an optimizer counting
    # micro-steps (Keras's built-in accumulation) reads the second rate
    # already at its first update.
    return keras.optimizers.schedules.PiecewiseConstantDecay([0], [0.1, 0.01])


INNER = {
    "sgd": lambda: keras.optimizers.SGD(_schedule(), momentum=0.9),
    "adam": lambda: keras.optimizers.Adam(_schedule()),
    "adamw": lambda: keras.optimizers.AdamW(_schedule(), weight_decay=0.1),
}


def _data_parallel():
    return keras.distribution.DataParallel(
        devices=keras.distribution.list_devices("cpu")
    )


def _scope(distribution):
    import contextlib

    return distribution.scope() if distribution else contextlib.nullcontext()


def _model():
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh", name="hidden"),
            keras.layers.Dense(4, name="out"),
        ]
    )


def _fit(make_optimizer, distribution=None, batch_size=MICRO, x=X, y=Y, **kw):
    """A model trained one epoch, unshuffled; optimizer made in scope."""
    with _scope(distribution):
        model = _model()
        model.compile(optimizer=make_optimizer(), loss="mse", **kw)
        model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0)
    return model


def _wrapped(name, steps=STEPS, **inner_kwargs):
    def make():
        inner = INNER[name]()
        for key, value in inner_kwargs.items():
            setattr(inner, key, value)
        return GradientAccumulationOptimizer(inner, steps)

    return make


def _max_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(u) - np.asarray(v))))
        for u, v in zip(a, b)
    )


def _loss(model, trainable, non_trainable, x, y):
    import jax.numpy as jnp

    pred, non_trainable = model.stateless_call(trainable, non_trainable, x)
    return jnp.mean(jnp.square(pred - y)), non_trainable


def _plain_large_batch(make_inner):
    """The plain computation: the inner optimizer alone, one device, one
    `apply` per large batch of `K` micro-batches (eager, as Keras runs an
    optimizer outside `fit`); EMA weights swapped in at the end, as `fit`
    does."""
    import jax

    model = _model()
    optimizer = make_inner()
    trainable = model.trainable_variables
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss(values, x, y):
        return _loss(model, values, non_trainable, x, y)[0]

    for start in range(0, len(X), LARGE):
        batch = slice(start, start + LARGE)
        grads = jax.grad(loss)([v.value for v in trainable], X[batch], Y[batch])
        optimizer.apply(grads, trainable)
    optimizer.finalize_variable_values(trainable)
    return model.get_weights()


@pytest.fixture(scope="module")
def large_batch():
    """Weights after plain training on the large batch, per optimizer."""
    cache = {}

    def get(name, **inner_kwargs):
        key = (name, tuple(sorted(inner_kwargs.items())))
        if key not in cache:

            def make():
                inner = INNER[name]()
                for k, v in inner_kwargs.items():
                    setattr(inner, k, v)
                return inner

            cache[key] = _plain_large_batch(make)
        return cache[key]

    return get


# ----------------------------------------------------------------------
# Exactness in fit
# ----------------------------------------------------------------------
@pytest.mark.backends("jax")
def test_fit_with_steps_per_execution(large_batch):
    dp = _fit(_wrapped("adam"), _data_parallel(), steps_per_execution=2)
    assert _max_diff(dp.get_weights(), large_batch("adam")) < TOLERANCE


@pytest.mark.backends("jax")
@pytest.mark.slow
def test_fit_without_jit(large_batch):
    eager = _fit(_wrapped("adam"), jit_compile=False)
    assert _max_diff(eager.get_weights(), large_batch("adam")) < TOLERANCE


@pytest.mark.backends("jax")
def test_ema_counts_updates(large_batch):
    """`use_ema` on the inner optimizer averages once per update; fit ends
    on the averages (`finalize_variable_values`), as without the wrapper."""
    ema = {"use_ema": True, "ema_momentum": 0.5}
    model = _fit(_wrapped("adam", **ema), _data_parallel())
    expected = large_batch("adam", **ema)
    assert _max_diff(model.get_weights(), expected) < TOLERANCE
    assert _max_diff(expected, large_batch("adam")) > 1e-3  # EMA mattered
    assert model.optimizer.use_ema


@pytest.mark.backends("jax")
def test_under_mixed_float16_loss_scaling_wraps_the_wrapper(large_batch):
    """`compile` puts a LossScaleOptimizer around the wrapper; its
    stateless path reaches ours. float16 compute: agreement to its
    rounding, and the counters still count updates."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        model = _fit(_wrapped("adam"), _data_parallel())
    finally:
        keras.mixed_precision.set_global_policy("float32")
    optimizer = model.optimizer
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(optimizer.inner_optimizer, GradientAccumulationOptimizer)
    assert int(optimizer.iterations) == 2
    assert int(optimizer.inner_optimizer.micro_steps) == 4
    assert _max_diff(model.get_weights(), large_batch("adam")) < 1e-3


# ----------------------------------------------------------------------
# Clipping applies to the accumulated (global) mean
# ----------------------------------------------------------------------
@pytest.mark.backends("jax")
@pytest.mark.parametrize(
    "clipping",
    [
        {"global_clipnorm": 0.05},
        pytest.param({"clipnorm": 0.05}, marks=pytest.mark.slow),
        pytest.param({"clipvalue": 0.01}, marks=pytest.mark.slow),
    ],
    ids=lambda clipping: next(iter(clipping)),
)
def test_clipping_applies_to_the_mean(large_batch, clipping):
    model = _fit(_wrapped("sgd", **clipping), _data_parallel())
    expected = large_batch("sgd", **clipping)
    assert _max_diff(model.get_weights(), expected) < TOLERANCE
    # The clip was active: the unclipped large batch ends elsewhere.
    assert _max_diff(expected, large_batch("sgd")) > 1e-3
    ((name, value),) = clipping.items()
    assert getattr(model.optimizer, name) == value  # the inner's


# ----------------------------------------------------------------------
# A custom JAX loop: stateless_call + jax.grad + stateless_apply in jit
# ----------------------------------------------------------------------
def _count_all_reduces(hlo: str) -> int:
    import re

    return len(re.findall(r"= [^\n]*all-reduce(?:-start)?\(", hlo))


def _sharded_batches(distribution, x, y, chunks):
    """`x`, `y` cut into `chunks` micro-batches, each split over the batch
    axis of the mesh."""
    import jax

    xs = x.reshape(chunks, -1, x.shape[-1])
    ys = y.reshape(chunks, -1, y.shape[-1])
    layout = distribution.get_data_layout(xs.shape[1:])
    spec = jax.sharding.PartitionSpec(None, *layout.backend_layout.spec)
    sharding = jax.sharding.NamedSharding(layout.backend_layout.mesh, spec)
    return jax.device_put(xs, sharding), jax.device_put(ys, sharding)


@pytest.mark.backends("jax")
def test_custom_stateless_loop(large_batch):
    import jax

    dist = _data_parallel()
    with dist.scope():
        model = _model()
        optimizer = _wrapped("adam")()
        optimizer.build(model.trainable_variables)

        @jax.jit
        def micro_step(state, x, y):
            trainable, non_trainable, optimizer_values = state
            grad_fn = jax.value_and_grad(
                lambda t: _loss(model, t, non_trainable, x, y), has_aux=True
            )
            (_, non_trainable), grads = grad_fn(trainable)
            trainable, optimizer_values = optimizer.stateless_apply(
                optimizer_values, grads, trainable
            )
            return trainable, non_trainable, optimizer_values

        state = (
            [v.value for v in model.trainable_variables],
            [v.value for v in model.non_trainable_variables],
            [v.value for v in optimizer.variables],
        )
        xs, ys = _sharded_batches(dist, X, Y, 4)
        for i in range(4):
            state = micro_step(state, xs[i], ys[i])
        for variable, value in zip(model.trainable_variables, state[0]):
            variable.assign(value)
        for variable, value in zip(optimizer.variables, state[2]):
            variable.assign(value)
        hlo = micro_step.lower(state, xs[0], ys[0]).compile().as_text()
    assert _max_diff(model.get_weights(), large_batch("adam")) < TOLERANCE
    assert int(optimizer.iterations) == 2 and int(optimizer.micro_steps) == 4
    # XLA reduces the gradient where it is computed, in every micro-step.
    assert _count_all_reduces(hlo) == 1


@pytest.mark.backends("jax")
@pytest.mark.slow
def test_reductions_of_micro_steps_in_one_compiled_call(large_batch):
    """K micro-steps inside one compiled function: handing the wrapper each
    micro-batch's gradient costs one all-reduce per micro-step (the
    gradients arrive reduced, and the update's `cond` separates them).
    Summing the micro-batches' gradients inside the function (`lax.scan`)
    before the wrapper sees them lets XLA reduce once per call; the
    wrapper then accumulates over calls, still exact."""
    import jax
    import jax.numpy as jnp

    dist = _data_parallel()
    with dist.scope():
        model = _model()
        per_micro = _wrapped("adam")()
        per_micro.build(model.trainable_variables)
        per_call = _wrapped("adam")()
        per_call.build(model.trainable_variables)
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]
        # 8 micro-batches of 8, two per device.
        xs, ys = _sharded_batches(dist, X, Y, 8)

        def grad(t, x, y):
            return jax.grad(lambda t: _loss(model, t, non_trainable, x, y)[0])(
                t
            )

        def micro_steps(t, opt_values, xs, ys):
            for i in range(xs.shape[0]):
                t, opt_values = per_micro.stateless_apply(
                    opt_values, grad(t, xs[i], ys[i]), t
                )
            return t, opt_values

        def summed_call(t, opt_values, xs, ys):
            def body(total, xy):
                return jax.tree.map(jnp.add, total, grad(t, *xy)), None

            zeros = jax.tree.map(jnp.zeros_like, t)
            total, _ = jax.lax.scan(body, zeros, (xs, ys))
            mean = [g / xs.shape[0] for g in total]
            return per_call.stateless_apply(opt_values, mean, t)

        values = [v.value for v in per_micro.variables]
        lowered = jax.jit(micro_steps).lower(trainable, values, xs, ys)
        assert _count_all_reduces(lowered.compile().as_text()) == 8
        step = jax.jit(summed_call)
        values = [v.value for v in per_call.variables]
        lowered = step.lower(trainable, values, xs[:2], ys[:2])
        assert _count_all_reduces(lowered.compile().as_text()) == 1
        t = trainable
        for start in range(0, 8, 2):
            t, values = step(
                t, values, xs[start : start + 2], ys[start : start + 2]
            )
        for variable, value in zip(model.trainable_variables, t):
            variable.assign(value)
        for variable, value in zip(per_call.variables, values):
            variable.assign(value)
    # 4 calls of 2 summed micro-batches of 8, accumulation_steps=2: two
    # updates, each on 32 samples, as the large batch.
    assert _max_diff(model.get_weights(), large_batch("adam")) < TOLERANCE
    assert int(per_call.iterations) == 2


# ----------------------------------------------------------------------
# Keras limits on JAX
# ----------------------------------------------------------------------
def _train_step_hlo(model, distribution):
    """The compiled HLO of the step `fit` jits (`model.train_step`)."""
    import jax

    state = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
        [v.value for v in model.optimizer.variables],
        [v.value for v in model.metrics_variables],
    )
    xs, ys = _sharded_batches(distribution, X[:MICRO], Y[:MICRO], 1)
    lowered = jax.jit(model.train_step).lower(state, (xs[0], ys[0]))
    return lowered.compile().as_text()


@pytest.mark.backends("jax")
@pytest.mark.keras_limit
def test_fit_reduces_every_micro_step():
    """Keras's JAX `train_step` takes the gradient of the globally sharded
    batch: XLA all-reduces it there, before any optimizer sees it, so K
    micro-steps in `fit` cost K reductions (one per micro-step), with or
    without accumulation. Fails when Keras's step stops reducing there."""
    dist = _data_parallel()
    model = _fit(_wrapped("sgd"), dist, x=X[:MICRO], y=Y[:MICRO])
    with dist.scope():
        hlo = _train_step_hlo(model, dist)
    assert _count_all_reduces(hlo) == 1
    # The (combined) all-reduce of the loss and every gradient runs in the
    # step's main computation, every micro-step; the optimizer's update is
    # a `conditional` of its own.
    import re

    computation, reductions = None, []
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            computation = line
        if re.search(r"= [^\n]*all-reduce\(", line):
            reductions.append((computation, line))
    ((computation, line),) = reductions
    assert computation.startswith("ENTRY")
    assert line.count("f32[") >= 1 + len(model.trainable_variables)
    assert "conditional(" in hlo


@pytest.mark.backends("jax")
@pytest.mark.keras_limit
def test_builtin_accumulation_counts_micro_steps_for_schedules(large_batch):
    """Keras's `gradient_accumulation_steps` evaluates the schedule on the
    micro-step counter: under DataParallel(4) it ends far from the large
    batch, where the wrapper is exact."""

    def builtin():
        return keras.optimizers.Adam(
            _schedule(), gradient_accumulation_steps=STEPS
        )

    dist = _data_parallel()
    theirs = _fit(builtin, dist).get_weights()
    ours = _fit(_wrapped("adam"), dist).get_weights()
    expected = large_batch("adam")
    moved = _max_diff(expected, [w for w in _model().get_weights()])
    assert _max_diff(ours, expected) < TOLERANCE
    assert _max_diff(theirs, expected) > 0.1 * moved


# ----------------------------------------------------------------------
# State: resume in the middle of a window
# ----------------------------------------------------------------------
@pytest.mark.backends("jax")
def test_resume_mid_window_from_a_keras_file(tmp_path, large_batch):
    first = _fit(_wrapped("adam"), x=X[:48], y=Y[:48])  # 3 micro-batches
    assert int(first.optimizer.pending_steps) == 1
    path = str(tmp_path / "mid.keras")
    first.save(path)
    loaded = keras.models.load_model(path)
    optimizer = loaded.optimizer
    assert isinstance(optimizer, GradientAccumulationOptimizer)
    assert optimizer.accumulation_steps == STEPS
    assert int(optimizer.pending_steps) == 1
    assert int(optimizer.iterations) == 1
    assert (
        _max_diff(
            [a.numpy() for a in optimizer.accumulators],
            [a.numpy() for a in first.optimizer.accumulators],
        )
        == 0.0
    )
    loaded.fit(X[48:], Y[48:], batch_size=MICRO, shuffle=False, verbose=0)
    assert _max_diff(loaded.get_weights(), large_batch("adam")) < TOLERANCE


@pytest.mark.backends("jax")
def test_resume_mid_window_from_weights_under_data_parallel(
    tmp_path, large_batch
):
    dist = _data_parallel()
    first = _fit(_wrapped("adam"), dist, x=X[:48], y=Y[:48])
    path = str(tmp_path / "mid.weights.h5")
    first.save_weights(path)
    with dist.scope():
        model = _model()
        model.compile(optimizer=_wrapped("adam")(), loss="mse")
        model.optimizer.build(model.trainable_variables)
        model.load_weights(path)
        assert int(model.optimizer.pending_steps) == 1
        model.fit(X[48:], Y[48:], batch_size=MICRO, shuffle=False, verbose=0)
    assert _max_diff(model.get_weights(), large_batch("adam")) < TOLERANCE


def test_eager_apply_and_missing_gradients():
    """`apply` outside any jit or stateless scope (a stateful custom loop):
    a variable without a gradient is left alone, with Keras's warning."""
    model = _model()
    optimizer = GradientAccumulationOptimizer(keras.optimizers.SGD(0.5), 2)
    before = model.get_weights()
    grads = [np.ones(v.shape, "float32") for v in model.trainable_variables]
    grads[1] = None  # hidden/bias
    for _ in range(2):
        with pytest.warns(UserWarning, match="Gradients do not exist"):
            optimizer.apply(grads, model.trainable_variables)
    after = model.get_weights()
    np.testing.assert_allclose(after[0], before[0] - 0.5, atol=1e-6)
    np.testing.assert_array_equal(after[1], before[1])
    assert int(optimizer.iterations) == 1
    assert int(optimizer.pending_steps) == 0


@pytest.mark.backends("jax")
def test_compression_refuses_on_jax():
    from keras_mgpu.backend import BackendNotSupportedError

    with pytest.raises(BackendNotSupportedError, match="'jax' backend") as e:
        GradientAccumulationOptimizer(
            keras.optimizers.SGD(), 2, compression="float16"
        )
    assert "without compression" in str(e.value)
    with pytest.raises(ValueError, match="needs an SGD inner optimizer"):
        GradientAccumulationOptimizer(
            keras.optimizers.Adam(), 2, momentum_correction=True
        )


# ----------------------------------------------------------------------
# Momentum correction (Goyal et al.) against its closed form
# ----------------------------------------------------------------------
@pytest.mark.backends("jax")
def test_momentum_correction_matches_rate_free_momentum():
    """`u = m*u + g; w -= lr_t*u` (float64) on a linear model, the rate
    changing at most updates, under DataParallel(4) with accumulation."""
    momentum, updates, micro = 0.9, 5, 16
    rates = keras.optimizers.schedules.PiecewiseConstantDecay(
        [0, 1, 3], [0.01, 0.05, 0.1, 0.03]
    )
    rng = np.random.default_rng(5)
    x = rng.normal(size=(updates * STEPS * micro, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1)) + 0.3).astype("float32")
    with _data_parallel().scope():
        model = keras.Sequential(
            [
                keras.Input((5,)),
                keras.layers.Dense(1, kernel_initializer="zeros"),
            ]
        )
        optimizer = GradientAccumulationOptimizer(
            keras.optimizers.SGD(rates, momentum=momentum),
            STEPS,
            momentum_correction=True,
        )
        model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=micro, shuffle=False, verbose=0)
    w, b = np.zeros((5, 1)), np.zeros((1,))
    u_w, u_b = np.zeros_like(w), np.zeros_like(b)
    large = STEPS * micro
    for t in range(updates):
        xb = x[t * large : (t + 1) * large].astype("float64")
        error = xb @ w + b - y[t * large : (t + 1) * large]
        u_w = momentum * u_w + 2.0 * xb.T @ error / large
        u_b = momentum * u_b + 2.0 * error.sum(axis=0) / large
        lr = float(rates(t))
        w, b = w - lr * u_w, b - lr * u_b
    weights = np.concatenate([v.ravel() for v in model.get_weights()])
    np.testing.assert_allclose(
        weights, np.concatenate([w.ravel(), b]), rtol=2e-5, atol=2e-6
    )
    assert int(optimizer.iterations) == updates
    assert float(optimizer.previous_learning_rate) == pytest.approx(
        float(rates(updates - 1))
    )

"""GradientAccumulationOptimizer: exact large-batch equivalence and semantics.

Reference for every comparison: the plain inner optimizer on one device
(default strategy) with a batch `accumulation_steps × global micro-batch`,
same initial weights, same sample order.
"""

from __future__ import annotations

import numpy as np
import pytest
from _training import assert_weights_close, mlp, regression_data

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras, tf
from keras_mgpu.normalization import BatchNormMicroBatchWarning

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
            tf.distribute.get_strategy(),
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
    assert int(optimizer.iterations.numpy()) == UPDATES
    assert int(optimizer.micro_steps.numpy()) == UPDATES * ACCUMULATION
    assert int(optimizer.pending_steps.numpy()) == 0


@pytest.mark.parametrize("optimizer_name", MATRIX_OPTIMIZERS)
def test_matches_large_batch_under_every_strategy(strategy, optimizer_name):
    _check_against_reference(strategy, optimizer_name)


@pytest.mark.parametrize(
    "optimizer_name",
    [name for name in OPTIMIZERS if name not in MATRIX_OPTIMIZERS],
)
def test_matches_large_batch_for_every_optimizer(optimizer_name):
    from conftest import make_strategy

    _check_against_reference(make_strategy("mirrored_2"), optimizer_name)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored_2"])
def test_float64_matches_large_batch_tightly(strategy_name):
    from conftest import make_strategy

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
            tf.distribute.get_strategy(), None, ACCUMULATION * MICRO_BATCH
        )
        actual = train(make_strategy(strategy_name), ACCUMULATION, MICRO_BATCH)
        assert actual[0].dtype == np.float64
        assert_weights_close(actual, expected, rtol=1e-10, atol=1e-12)
    finally:
        keras.backend.set_floatx("float32")


@pytest.mark.parametrize("strategy_name", ["default", "one_device"])
@pytest.mark.parametrize(
    "compile_kw",
    [{"steps_per_execution": 4}, {"jit_compile": True}],
    ids=["steps_per_execution_4", "jit_compile"],
)
def test_steps_per_execution_and_jit_compile(strategy_name, compile_kw):
    from conftest import make_strategy

    _check_against_reference(
        make_strategy(strategy_name), "momentum", **compile_kw
    )


def test_steps_per_execution_under_mirrored_works_with_the_wrapper():
    # Plain Keras 3.15 fails here (tests/test_keras_limits.py); with the
    # wrapper the update runs in cross-replica context and succeeds.
    from conftest import make_strategy

    _check_against_reference(
        make_strategy("mirrored_2"), "momentum", steps_per_execution=4
    )


def test_jit_compile_under_mirrored_on_cpu_raises_clearly():
    from conftest import make_strategy

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
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(0.01)


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


def test_sparse_embedding_gradients_match_large_batch():
    # SGD with momentum is linear in the gradient, so Keras's sparse path
    # (IndexedSlices with repeated rows) and our dense accumulators agree.
    def sgd():
        return keras.optimizers.SGD(0.05, momentum=0.9)

    expected = _fit_embedding(sgd(), 24)
    actual = _fit_embedding(GradientAccumulationOptimizer(sgd(), 4), 6)
    assert_weights_close(actual, expected)


def test_sparse_gradients_with_adam_match_dense_large_batch():
    # Adam squares the gradient. Keras 3.15 squares each IndexedSlices row
    # separately, repeated rows included, so its own sparse large batch is
    # not the dense-gradient Adam step. The wrapper accumulates densely and
    # matches the large batch computed with dense gradients.
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
    optimizer.apply([tf.constant([np.nan, 1.0])], [v])
    optimizer.apply([tf.constant([1.0, 1.0])], [v])
    np.testing.assert_array_equal(v.numpy(), [0.0, 0.0])
    assert int(optimizer.skipped_updates.numpy()) == 1
    assert int(optimizer.iterations.numpy()) == 0
    optimizer.apply([tf.constant([2.0, 2.0])], [v])
    optimizer.apply([tf.constant([4.0, 4.0])], [v])
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


def test_rejects_legacy_tf_optimizer():
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


@pytest.mark.parametrize("argument", ["clipnorm", "learning_rate", "use_ema"])
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
    # Registered: generic deserialization finds the class by name.
    generic = keras.optimizers.deserialize(
        keras.optimizers.serialize(optimizer)
    )
    assert isinstance(generic, GradientAccumulationOptimizer)
    assert generic.get_config() == config

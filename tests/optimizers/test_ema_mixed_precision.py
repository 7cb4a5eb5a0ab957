"""EMA of the weights through GradientAccumulationOptimizer, in float32 and
under `mixed_float16` (where `compile` wraps the wrapper in a
`LossScaleOptimizer`), with Keras's own `SwapEMAWeights`.

Every run is compared with Keras's behaviour on the plain large batch: the
inner optimizer alone (with `use_ema=True`) on batches of
`ACCUMULATION * BATCH` samples, with the same callback. 32 samples make 8
micro-batches (2 updates) per epoch.
"""

from __future__ import annotations

import numpy as np
import pytest
from _training import mlp, regression_data
from conftest import make_strategy

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras, tf

ACCUMULATION = 4
BATCH = 4
SAMPLES = 32
# fp16 forward passes on micro-batches of 4 against batches of 16 round
# differently: measured 6e-5 on the averages and 3e-4 on the validation
# loss (float32: 3e-8 and 0).
TOLERANCE = {"float32": 1e-5, "mixed_float16": 2e-3}


@pytest.fixture(params=("float32", "mixed_float16"))
def policy(request):
    keras.mixed_precision.set_global_policy(request.param)
    yield request.param
    keras.mixed_precision.set_global_policy("float32")


def _fresh_session(policy: str) -> None:
    # `clear_session` puts the global dtype policy back to float32.
    keras.backend.clear_session()
    keras.mixed_precision.set_global_policy(policy)


def _inner(use_ema: bool = True):
    # A small EMA momentum keeps the averages visibly apart from the
    # weights; Nesterov momentum makes the inner's slots matter too.
    return keras.optimizers.SGD(
        0.05, momentum=0.9, use_ema=use_ema, ema_momentum=0.5
    )


def _data():
    x, y = regression_data(SAMPLES)
    xv, yv = regression_data(16, seed=1)
    return x, y, xv, yv


def _averages(model) -> list:
    """The EMA values Keras's `SwapEMAWeights` finds for this model."""
    optimizer = model.optimizer
    if hasattr(optimizer, "inner_optimizer"):  # LossScaleOptimizer
        optimizer = optimizer.inner_optimizer
    return [v.numpy() for v in optimizer._model_variables_moving_average]


def _close(actual, expected, tolerance) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=0, atol=tolerance)


def _large_batch_fit(epochs: int, **fit_kwargs):
    model = mlp()
    model.compile(optimizer=_inner(), loss="mse")
    x, y, xv, yv = _data()
    history = model.fit(
        x,
        y,
        batch_size=ACCUMULATION * BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        validation_data=(xv, yv),
        callbacks=[keras.callbacks.SwapEMAWeights(**fit_kwargs)],
    )
    return model, history


def test_wrapper_reports_the_inner_ema_and_keeps_no_copy():
    optimizer = GradientAccumulationOptimizer(_inner(), ACCUMULATION)
    model = mlp()
    model.compile(optimizer=optimizer, loss="mse")
    optimizer.build(model.trainable_variables)
    assert optimizer.use_ema is True
    assert optimizer.ema_momentum == 0.5
    averages = optimizer._model_variables_moving_average
    assert averages is optimizer.inner_optimizer._model_variables_moving_average
    assert len(averages) == len(model.trainable_variables)
    # The averages exist once, on the inner optimizer.
    names = [v.path for v in optimizer.variables]
    assert len(names) == len(set(names))
    assert sum("average" in name for name in names) == len(averages)
    plain = GradientAccumulationOptimizer(_inner(False), ACCUMULATION)
    assert plain.use_ema is False
    assert not hasattr(plain, "_model_variables_moving_average")


@pytest.mark.parametrize(
    "policy, strategy_name",
    [
        ("float32", "default"),
        ("mixed_float16", "default"),
        ("mixed_float16", "mirrored_2"),
    ],
    indirect=["policy"],
)
def test_fit_with_swap_ema_weights_equals_the_large_batch(
    policy, strategy_name
):
    """`SwapEMAWeights` evaluates with the averages (validation loss), puts
    the weights back for training, and `fit` ends on the averages; all as
    with the plain optimizer on the large batch. Before the wrapper showed
    the inner's averages, the callback raised under mixed_float16."""
    expected, expected_history = _large_batch_fit(epochs=2)
    expected_weights = expected.get_weights()
    expected_averages = _averages(expected)
    _fresh_session(policy)

    strategy = make_strategy(strategy_name)
    with strategy.scope():
        model = mlp()
        model.compile(
            optimizer=GradientAccumulationOptimizer(_inner(), ACCUMULATION),
            loss="mse",
        )
    if policy == "mixed_float16":
        assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    x, y, xv, yv = _data()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(xv, yv),
        callbacks=[keras.callbacks.SwapEMAWeights()],
    )
    tolerance = TOLERANCE[policy]
    np.testing.assert_allclose(
        history.history["val_loss"],
        expected_history.history["val_loss"],
        rtol=0,
        atol=tolerance,
    )
    _close(_averages(model), expected_averages, tolerance)
    # `fit` ends by writing the averages into the model.
    _close(model.get_weights(), expected_weights, tolerance)
    _close(model.get_weights(), _averages(model), 0)
    assert int(model.optimizer.iterations.numpy()) == 2 * SAMPLES // (
        ACCUMULATION * BATCH
    )


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_swap_on_epoch_equals_the_large_batch(policy):
    expected, _ = _large_batch_fit(epochs=2, swap_on_epoch=True)
    expected_weights = expected.get_weights()
    _fresh_session(policy)
    model = mlp()
    model.compile(
        optimizer=GradientAccumulationOptimizer(_inner(), ACCUMULATION),
        loss="mse",
    )
    x, y, xv, yv = _data()
    model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=2,
        shuffle=False,
        verbose=0,
        validation_data=(xv, yv),
        callbacks=[keras.callbacks.SwapEMAWeights(swap_on_epoch=True)],
    )
    _close(model.get_weights(), expected_weights, TOLERANCE[policy])


def _custom_loop(model, batch: int) -> None:
    """Keras's documented custom loop: scale the loss, apply the scaled
    gradients (a `LossScaleOptimizer` unscales them)."""
    optimizer = model.optimizer
    loss_fn = keras.losses.MeanSquaredError()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_fn(y, model(x, training=True))
            scaled = optimizer.scale_loss(loss)
        grads = tape.gradient(scaled, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)

    x, y, _, _ = _data()
    for start in range(0, SAMPLES, batch):
        step(x[start : start + batch], y[start : start + batch])


def test_custom_loop_and_swap_in_evaluate_equal_the_large_batch(policy):
    expected = mlp()
    expected.compile(optimizer=_inner(), loss="mse")
    _custom_loop(expected, ACCUMULATION * BATCH)
    _, _, xv, yv = _data()
    expected_loss = expected.evaluate(
        xv, yv, verbose=0, callbacks=[keras.callbacks.SwapEMAWeights()]
    )
    expected_averages = _averages(expected)
    _fresh_session(policy)

    model = mlp()
    model.compile(
        optimizer=GradientAccumulationOptimizer(_inner(), ACCUMULATION),
        loss="mse",
    )
    _custom_loop(model, BATCH)
    tolerance = TOLERANCE[policy]
    averages = _averages(model)
    _close(averages, expected_averages, tolerance)

    weights = model.get_weights()
    assert max(np.max(np.abs(w - a)) for w, a in zip(weights, averages)) > 1e-3
    callback = keras.callbacks.SwapEMAWeights()
    loss = model.evaluate(xv, yv, verbose=0, callbacks=[callback])
    np.testing.assert_allclose(loss, expected_loss, rtol=0, atol=tolerance)
    # Swapped back after evaluation (by additions: float rounding).
    _close(model.get_weights(), weights, 1e-6)
    _close(_averages(model), averages, 1e-6)
    # The evaluation saw the averages.
    model.set_weights(averages)
    np.testing.assert_allclose(
        model.evaluate(xv, yv, verbose=0), loss, rtol=1e-6
    )


def test_keras_file_round_trip_keeps_the_averages(policy, tmp_path):
    """Saved after 1.5 windows (one update, 2 micro-batches pending) and
    resumed, the run equals the uninterrupted one, averages included."""
    x, y, xv, yv = _data()

    def fresh():
        model = mlp()
        model.compile(
            optimizer=GradientAccumulationOptimizer(_inner(), ACCUMULATION),
            loss="mse",
        )
        return model

    def fit(model, x, y):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            shuffle=False,
            verbose=0,
            validation_data=(xv, yv),
            callbacks=[keras.callbacks.SwapEMAWeights()],
        )

    split = 6 * BATCH
    uninterrupted = fresh()
    fit(uninterrupted, x[:split], y[:split])
    fit(uninterrupted, x[split:], y[split:])
    expected_averages = _averages(uninterrupted)
    expected_weights = uninterrupted.get_weights()
    _fresh_session(policy)

    model = fresh()
    fit(model, x[:split], y[:split])
    averages = _averages(model)
    path = str(tmp_path / "model.keras")
    model.save(path)
    _fresh_session(policy)
    loaded = keras.saving.load_model(path)
    optimizer = loaded.optimizer
    if policy == "mixed_float16":
        assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
        optimizer = optimizer.inner_optimizer
    assert isinstance(optimizer, GradientAccumulationOptimizer)
    assert optimizer.use_ema is True
    assert int(optimizer.pending_steps.numpy()) == 2
    _close(_averages(loaded), averages, 0)
    fit(loaded, x[split:], y[split:])
    _close(_averages(loaded), expected_averages, 1e-6)
    _close(loaded.get_weights(), expected_weights, 1e-6)


@pytest.mark.parametrize("policy", ["mixed_float16"], indirect=True)
def test_swap_without_ema_on_the_inner_still_refuses(policy):
    model = mlp()
    model.compile(
        optimizer=GradientAccumulationOptimizer(_inner(False), ACCUMULATION),
        loss="mse",
    )
    x, y, _, _ = _data()
    with pytest.raises(ValueError, match="use_ema=True"):
        model.fit(
            x,
            y,
            batch_size=BATCH,
            verbose=0,
            validation_data=(x, y),
            callbacks=[keras.callbacks.SwapEMAWeights()],
        )

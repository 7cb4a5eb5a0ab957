"""GradientAccumulationOptimizer under tf_keras: large-batch equivalence,
resumption mid-window, multi-worker and parameter-server `model.fit`.

Reference for every comparison: the plain inner optimizer on one device
(default strategy) with a batch `accumulation_steps × global micro-batch`,
same initial weights, same sample order.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _processes import run_in_process, run_workers
from _training import assert_weights_close, max_abs_diff, mlp, regression_data
from conftest import make_strategy

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import IS_TF_KERAS, keras, tf
from keras_mgpu.optimizers import gradient_accumulation_tf_keras

assert IS_TF_KERAS, "tests/legacy runs with TF_USE_LEGACY_KERAS=1"

ACCUMULATION = 3
MICRO_BATCH = 8  # global micro-batch (split across replicas)
UPDATES = 4
SAMPLES = ACCUMULATION * MICRO_BATCH * UPDATES
X, Y = regression_data(SAMPLES)


def _optimizers() -> dict:
    schedule = keras.optimizers.schedules.ExponentialDecay(0.05, 2, 0.5)
    return {
        # Clipping on, and tight enough to act (checked below).
        "adam_clip": lambda: keras.optimizers.Adam(0.01, global_clipnorm=0.05),
        "adam_noclip": lambda: keras.optimizers.Adam(0.01),
        "momentum_clipnorm": lambda: keras.optimizers.SGD(
            0.05, momentum=0.9, clipnorm=0.05
        ),
        "nesterov_schedule_ema": lambda: keras.optimizers.SGD(
            schedule, momentum=0.9, nesterov=True, use_ema=True
        ),
        "adamw": lambda: keras.optimizers.AdamW(0.01, weight_decay=0.2),
        "rmsprop_clipvalue": lambda: keras.optimizers.RMSprop(
            0.005, clipvalue=0.01
        ),
    }


OPTIMIZERS = _optimizers()
_reference_cache: dict = {}


def _compile(strategy, optimizer_name, accumulation, **compile_kw):
    with strategy.scope():
        model = mlp()
        optimizer = OPTIMIZERS[optimizer_name]()
        if accumulation:
            optimizer = GradientAccumulationOptimizer(optimizer, accumulation)
        model.compile(optimizer=optimizer, loss="mse", **compile_kw)
    return model


def _fit(model, x=X, y=Y, batch_size=MICRO_BATCH, **kw):
    model.fit(x, y, batch_size=batch_size, shuffle=False, verbose=0, **kw)
    return model


def _reference(optimizer_name: str) -> list:
    if optimizer_name not in _reference_cache:
        model = _compile(tf.distribute.get_strategy(), optimizer_name, 0)
        _fit(model, batch_size=MICRO_BATCH * ACCUMULATION)
        _reference_cache[optimizer_name] = model.get_weights()
    return _reference_cache[optimizer_name]


def test_matches_large_batch_under_every_strategy(strategy):
    model = _fit(_compile(strategy, "adam_clip", ACCUMULATION))
    assert_weights_close(model.get_weights(), _reference("adam_clip"))
    optimizer = model.optimizer
    assert int(optimizer.iterations.numpy()) == UPDATES
    assert int(optimizer.micro_steps.numpy()) == UPDATES * ACCUMULATION
    assert int(optimizer.pending_steps.numpy()) == 0
    assert int(optimizer.skipped_updates.numpy()) == 0


def test_clipping_in_the_reference_acts():
    # Otherwise the clipping cases above would prove nothing.
    assert max_abs_diff(_reference("adam_clip"), _reference("adam_noclip")) > (
        1e-3
    )


@pytest.mark.parametrize(
    "optimizer_name",
    [
        "momentum_clipnorm",
        "nesterov_schedule_ema",
        "adamw",
        "rmsprop_clipvalue",
    ],
)
def test_matches_large_batch_for_every_optimizer(optimizer_name):
    model = _fit(
        _compile(make_strategy("mirrored_2"), optimizer_name, ACCUMULATION)
    )
    assert_weights_close(model.get_weights(), _reference(optimizer_name))


def test_learning_rate_schedule_advances_per_update():
    model = _fit(
        _compile(
            tf.distribute.get_strategy(), "nesterov_schedule_ema", ACCUMULATION
        )
    )
    schedule = model.optimizer.inner_optimizer._learning_rate
    assert float(model.optimizer.learning_rate.numpy()) == pytest.approx(
        float(schedule(UPDATES - 1))
    )


def test_learning_rate_passthrough_setter():
    optimizer = GradientAccumulationOptimizer(keras.optimizers.SGD(0.1), 2)
    optimizer.learning_rate = 0.25
    assert float(optimizer.inner_optimizer.learning_rate.numpy()) == 0.25
    assert float(keras.backend.get_value(optimizer.lr)) == 0.25


def _accumulator_total(optimizer) -> float:
    return float(sum(np.abs(a.numpy()).sum() for a in optimizer.accumulators))


def test_checkpoint_and_keras_file_resume_mid_window(tmp_path):
    """Stop one micro-batch into a window on 2 replicas; resume from a
    checkpoint on 1 device and from a `.keras` file on 2 replicas: same
    result as an uninterrupted run."""
    first = ACCUMULATION * 2 + 1
    split = first * MICRO_BATCH
    model = _fit(
        _compile(make_strategy("mirrored_2"), "adam_clip", ACCUMULATION),
        X[:split],
        Y[:split],
    )
    assert int(model.optimizer.pending_steps.numpy()) == 1
    total = _accumulator_total(model.optimizer)
    assert total > 0
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt")
    )
    model.save(str(tmp_path / "model.keras"))

    one = make_strategy("one_device")
    from_ckpt = _compile(one, "adam_clip", ACCUMULATION)
    with one.scope():
        from_ckpt.optimizer.build(from_ckpt.trainable_variables)
    tf.train.Checkpoint(model=from_ckpt, optimizer=from_ckpt.optimizer).restore(
        path
    ).assert_consumed()

    two = make_strategy("mirrored_2")
    with two.scope():
        from_file = keras.models.load_model(str(tmp_path / "model.keras"))
    for restored in (from_ckpt, from_file):
        optimizer = restored.optimizer
        assert isinstance(optimizer, GradientAccumulationOptimizer)
        assert int(optimizer.pending_steps.numpy()) == 1
        assert _accumulator_total(optimizer) == pytest.approx(total, rel=1e-6)
        _fit(restored, X[split:], Y[split:])
        assert_weights_close(restored.get_weights(), _reference("adam_clip"))
        assert int(optimizer.iterations.numpy()) == UPDATES


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("simulated preemption")


def test_backup_and_restore_resumes_mid_window(tmp_path):
    """Epochs of 4 micro-batches with K=3 end mid-window. BackupAndRestore
    backs up after epoch 0 (one micro-batch pending), the run dies in epoch
    1, a new run resumes from the backup: same result as no interruption.
    (tf_keras restarts an epoch's data on resumption, so the backup is taken
    at epoch ends.)"""
    epochs, samples = 3, 4 * MICRO_BATCH
    x, y = X[:samples], Y[:samples]
    reference = _fit(
        _compile(tf.distribute.get_strategy(), "adam_clip", 0),
        np.concatenate([x] * epochs),
        np.concatenate([y] * epochs),
        batch_size=MICRO_BATCH * ACCUMULATION,
    )
    strategy = make_strategy("mirrored_2")
    backup = str(tmp_path / "backup")
    model = _compile(strategy, "adam_clip", ACCUMULATION)
    with pytest.raises(RuntimeError, match="simulated preemption"):
        _fit(
            model,
            x,
            y,
            epochs=epochs,
            callbacks=[
                keras.callbacks.BackupAndRestore(backup),
                _Interrupt(epoch=1, batch=1),
            ],
        )
    resumed = _compile(strategy, "adam_clip", ACCUMULATION)
    _fit(
        resumed,
        x,
        y,
        epochs=epochs,
        callbacks=[keras.callbacks.BackupAndRestore(backup)],
    )
    assert_weights_close(resumed.get_weights(), reference.get_weights())
    assert int(resumed.optimizer.iterations.numpy()) == UPDATES


def test_mixed_float16_under_mirrored_matches_large_batch():
    """`compile` puts LossScaleOptimizer outside the wrapper; it hands over
    gradients already summed over replicas."""
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        strategy = make_strategy("mirrored_2")
        model = _fit(_compile(strategy, "adam_noclip", ACCUMULATION))
        reference = _fit(
            _compile(tf.distribute.get_strategy(), "adam_noclip", 0),
            batch_size=MICRO_BATCH * ACCUMULATION,
        )
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert isinstance(model.optimizer, keras.mixed_precision.LossScaleOptimizer)
    assert isinstance(
        model.optimizer.inner_optimizer, GradientAccumulationOptimizer
    )
    assert int(model.optimizer.iterations.numpy()) == UPDATES
    assert_weights_close(
        model.get_weights(), reference.get_weights(), rtol=1e-2, atol=2e-3
    )


def test_sparse_embedding_gradients_match_large_batch():
    ids = np.random.default_rng(3).integers(0, 20, size=(SAMPLES, 3))

    def run(accumulation, batch_size):
        keras.utils.set_random_seed(5)
        model = keras.Sequential(
            [
                keras.layers.Embedding(20, 4, input_length=3),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )
        optimizer = keras.optimizers.SGD(0.1, momentum=0.9)
        if accumulation:
            optimizer = GradientAccumulationOptimizer(optimizer, accumulation)
        model.compile(optimizer=optimizer, loss="mse")
        return _fit(model, ids, Y, batch_size=batch_size).get_weights()

    assert_weights_close(
        run(ACCUMULATION, MICRO_BATCH), run(0, MICRO_BATCH * ACCUMULATION)
    )


def test_nonfinite_window_is_skipped_and_accumulators_restart():
    strategy = make_strategy("mirrored_2")
    with strategy.scope():
        variable = tf.Variable([1.0, 2.0])
        optimizer = GradientAccumulationOptimizer(keras.optimizers.SGD(1.0), 2)

    @tf.function
    def step(value):
        def replica_fn():
            optimizer.apply_gradients([(tf.fill([2], value), variable)])

        strategy.run(replica_fn)

    step(tf.constant(np.nan))
    step(tf.constant(1.0))  # completes the window: skipped
    np.testing.assert_array_equal(variable.numpy(), [1.0, 2.0])
    assert int(optimizer.skipped_updates.numpy()) == 1
    assert int(optimizer.iterations.numpy()) == 0
    assert _accumulator_total(optimizer) == 0.0
    step(tf.constant(0.5))
    step(tf.constant(0.5))
    # Mean over 2 micro-steps of the sum over 2 replicas of 0.5.
    np.testing.assert_allclose(variable.numpy(), [0.0, 1.0])
    assert int(optimizer.iterations.numpy()) == 1


@pytest.mark.slow
def test_multi_worker_mirrored_fit_resumes_mid_window():
    """2 MultiWorkerMirrored workers: `model.fit` with accumulation (plus
    RecomputeGrad, LR scaler and warmup callbacks, both monitors), a
    checkpoint one micro-batch into a window, restore, finish; equals one
    device at batch K·R·b with the closed-form learning rate."""
    results = run_workers(
        "legacy.ga_bodies:multi_worker_body",
        num_workers=2,
        timeout=200,
        env={"TF_USE_LEGACY_KERAS": "1"},
    )
    for result in results:
        assert result["replicas"] == 2
        assert result["pending_at_save"] == 1
        assert result["pending_restored"] == 1
        assert result["accumulator_sum"] > 0
        assert result["accumulator_sum_restored"] == pytest.approx(
            result["accumulator_sum"], rel=1e-6
        )
        assert result["iterations"] == 3
        assert result["micro_steps"] == 6
        assert result["max_abs_diff"] < 1e-5
        assert result["monitor_keys"]
    # gather_workers=True in the first fit: both workers logged both
    # workers' memory, the same numbers on each.
    assert results[0]["gathered_rss"] == results[1]["gathered_rss"]
    assert all(rss and rss > 10 for rss in results[0]["gathered_rss"])


@pytest.mark.slow
def test_parameter_server_fit_matches_large_batch():
    """In-process cluster (1 worker, 2 parameter servers on 127.0.0.1),
    `model.fit` with a DatasetCreator (plus RecomputeGrad, a Warmup
    schedule, the LR scaler, both monitors): accumulators live on the
    parameter servers and the result equals one device at batch K·b."""
    result = run_in_process(
        "legacy.ga_bodies:parameter_server_body",
        timeout=200,
        env={"TF_USE_LEGACY_KERAS": "1"},
    )
    assert result["max_abs_diff"] < 1e-5
    assert result["iterations"] == 3
    assert result["micro_steps"] == 6
    assert result["pending"] == 0
    assert result["accumulator_devices"] == [
        "/job:ps/replica:0/task:0",
        "/job:ps/replica:0/task:1",
    ]
    assert result["monitor_keys"]
    assert (
        "needs a strategy that all-reduces gradients"
        in (result["compression_error"])
    )
    assert "ParameterServerStrategy" in result["compression_error"]


def test_config_round_trip():
    optimizer = GradientAccumulationOptimizer(
        keras.optimizers.Adam(0.003, global_clipnorm=1.0), 4, name="acc"
    )
    config = keras.optimizers.serialize(optimizer)
    restored = keras.optimizers.deserialize(config, use_legacy_optimizer=False)
    assert isinstance(restored, GradientAccumulationOptimizer)
    assert restored.accumulation_steps == 4
    assert restored.name == "acc"
    inner = restored.inner_optimizer
    assert isinstance(inner, keras.optimizers.Adam)
    assert inner.global_clipnorm == 1.0
    assert float(inner.learning_rate.numpy()) == pytest.approx(0.003)
    assert restored.get_config() == optimizer.get_config()


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
        (2.0, TypeError, r"Received: accumulation_steps=2\.0 \(of type float"),
        (True, TypeError, r"accumulation_steps=True"),
    ],
)
def test_bad_accumulation_steps(steps, error, message):
    with pytest.raises(error, match=message):
        GradientAccumulationOptimizer(keras.optimizers.SGD(), steps)


def test_keras3_model_rejects_the_tf_keras_wrapper():
    import keras as keras3

    model = keras3.Sequential([keras3.Input((2,)), keras3.layers.Dense(1)])
    with pytest.raises(ValueError, match="Could not interpret optimizer"):
        model.compile(
            optimizer=GradientAccumulationOptimizer(keras.optimizers.SGD(), 2),
            loss="mse",
        )


def test_rejects_legacy_tf_keras_optimizer():
    with pytest.raises(
        TypeError, match=r"not a `tf_keras.optimizers.legacy` optimizer"
    ):
        GradientAccumulationOptimizer(keras.optimizers.legacy.SGD(), 2)


def test_rejects_non_optimizer():
    with pytest.raises(TypeError, match=r"Received: inner_optimizer='sgd'"):
        GradientAccumulationOptimizer("sgd", 2)


def test_rejects_wrapping_twice():
    once = GradientAccumulationOptimizer(keras.optimizers.SGD(), 2)
    with pytest.raises(ValueError, match=r"already a .*accumulation_steps=2"):
        GradientAccumulationOptimizer(once, 2)


def test_rejects_loss_scale_optimizer_inside():
    inner = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(ValueError, match=r"Put loss scaling outside"):
        GradientAccumulationOptimizer(inner, 2)


@pytest.mark.parametrize(
    "argument", ["learning_rate", "clipnorm", "weight_decay", "use_ema"]
)
def test_rejects_base_arguments_meant_for_inner(argument):
    with pytest.raises(
        ValueError, match=rf"does not take `{argument}`.*on the `inner"
    ):
        GradientAccumulationOptimizer(
            keras.optimizers.SGD(), 2, **{argument: 0.1}
        )


def test_rejects_unknown_arguments():
    with pytest.raises(TypeError, match=r"unexpected arguments: colour"):
        GradientAccumulationOptimizer(keras.optimizers.SGD(), 2, colour=1)


def test_rejects_apply_in_cross_replica_context():
    optimizer = GradientAccumulationOptimizer(keras.optimizers.SGD(), 2)
    strategy = make_strategy("mirrored_2")
    with strategy.scope():
        variable = tf.Variable([1.0])
        with pytest.raises(ValueError, match=r"must be called in a replica"):
            optimizer.apply_gradients([(tf.ones([1]), variable)])


def test_rejects_unknown_variables():
    optimizer = GradientAccumulationOptimizer(keras.optimizers.SGD(), 2)
    optimizer.build([tf.Variable([1.0])])
    with pytest.raises(ValueError, match=r"not among the variables"):
        optimizer.apply_gradients([(tf.ones([1]), tf.Variable([2.0]))])


def test_module_is_the_flavour_pick():
    assert (
        GradientAccumulationOptimizer
        is gradient_accumulation_tf_keras.GradientAccumulationOptimizer
    )
    assert os.environ.get("TF_USE_LEGACY_KERAS") == "1"


@pytest.mark.parametrize("strategy_name", ["default", "mirrored_2"])
def test_momentum_correction_matches_rate_free_momentum(strategy_name):
    from _momentum_correction import train

    weights, expected, _ = train(
        make_strategy(strategy_name), 2, correction=True, nesterov=False
    )
    np.testing.assert_allclose(weights, expected, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("policy", ["float32", "mixed_float16"])
def test_ema_through_the_wrapper_matches_large_batch(policy):
    """tf_keras has no `SwapEMAWeights`; its EMA surface is `use_ema` (which
    its `LossScaleOptimizer` forwards to the optimizer it wraps) and
    `finalize_variable_values` at the end of `fit`, which writes the
    averages into the model. Through the wrapper (and, under
    mixed_float16, the `LossScaleOptimizer` around it), both equal the
    plain optimizer with EMA on the large batch."""

    def inner():
        return keras.optimizers.SGD(
            0.05, momentum=0.9, use_ema=True, ema_momentum=0.5
        )

    keras.mixed_precision.set_global_policy(policy)
    try:
        reference = mlp()
        reference.compile(optimizer=inner(), loss="mse")
        _fit(reference, batch_size=ACCUMULATION * MICRO_BATCH)
        model = mlp()
        model.compile(
            optimizer=GradientAccumulationOptimizer(inner(), ACCUMULATION),
            loss="mse",
        )
        assert model.optimizer.use_ema is True
        _fit(model)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    wrapper = model.optimizer
    if policy == "mixed_float16":
        assert isinstance(wrapper, keras.mixed_precision.LossScaleOptimizer)
        wrapper = wrapper.inner_optimizer
    averages = wrapper._model_variables_moving_average
    assert averages is wrapper.inner_optimizer._model_variables_moving_average
    # `fit` ended on the averages, as the plain optimizer's did.
    for weight, average in zip(model.trainable_variables, averages):
        np.testing.assert_array_equal(weight.numpy(), average.numpy())
    tolerance = 1e-5 if policy == "float32" else 2e-3
    assert_weights_close(
        model.get_weights(), reference.get_weights(), rtol=0, atol=tolerance
    )

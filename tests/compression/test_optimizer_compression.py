"""GradientAccumulationOptimizer(compression=...) under tf.distribute (Keras
3): the bytes each update sends, measured by CrossDeviceByteCounter; the
first update against the float32 all-reduce; one replica; clipping;
delayed start; mixed precision; sparse gradients; resume; bad input."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from _loops import Loop, mlp, regression
from conftest import make_strategy

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras
from keras_mgpu.compression import PowerSGD
from keras_mgpu.demo import build_model

LEARNING_RATE = 0.05
ACCUMULATION = 2
MICRO_BATCH = 16  # global, split 8 / 8 over 2 replicas
# keras_mgpu.demo.build_model: 5 kernels (3x3x1x16, 3x3x16x32, 3x3x32x32,
# 512x64, 64x10) and 5 biases (16, 32, 32, 64, 10).
DEMO_PARAMETERS = 47530
# PowerSGD rank 2: (n + m) x 2 per kernel viewed as n x m, biases as they
# are: (9+16 + 144+32 + 288+32 + 512+64 + 64+10) x 2 + 154.
DEMO_POWER_SGD_ELEMENTS = 2496


def _digits_like(samples: int):
    rng = np.random.default_rng(11)
    x = rng.uniform(size=(samples, 8, 8, 1)).astype("float32")
    y = rng.integers(0, 10, size=samples).astype("int32")
    return x, y


def _demo_model():
    keras.utils.set_random_seed(5)
    return build_model(recompute=False)


def _demo_loop(strategy, compression):
    return Loop(
        strategy,
        _demo_model,
        lambda: keras.optimizers.SGD(LEARNING_RATE),
        compression,
        accumulation=ACCUMULATION,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )


DEMO_METHODS = {
    "float32": None,
    "float16": "float16",
    "bfloat16": "bfloat16",
    "power_sgd": PowerSGD(rank=2, start_after_updates=0),
}


@pytest.fixture(scope="module")
def demo_runs():
    """Each method on the demo CNN under mirrored x2: 2 updates of K=2."""
    strategy = make_strategy("mirrored_2")
    x, y = _digits_like(4 * MICRO_BATCH)
    runs = {}
    for name, method in DEMO_METHODS.items():
        loop = _demo_loop(strategy, method)
        run = {"initial": loop.weights()}
        loop.micro_step(x[:16], y[:16])
        run["bytes_after_one_micro_step"] = loop.counter.total_bytes()
        loop.micro_step(x[16:32], y[16:32])
        run["first"] = loop.weights()
        run["records"] = loop.counter.records()
        loop.counter.reset()
        loop.micro_step(x[32:48], y[32:48])
        loop.micro_step(x[48:64], y[48:64])
        run["second_records"] = loop.counter.records()
        run["replicas_agree"] = loop.replica_copies_agree()
        loop.close()
        runs[name] = run
    runs["shares"] = _replica_shares(runs["float32"]["initial"], x[:32], y[:32])
    return runs


def _replica_shares(initial, x, y) -> list:
    """Each replica's share of the first update's mean gradient, computed
    on one device: (1/K) sum over micro-steps of the gradient of the mean
    loss on the replica's 8 samples, divided by the 2 replicas."""
    model = build_model(recompute=False)
    model.set_weights(initial)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    shares = []
    for replica in range(2):
        total = None
        for step in range(ACCUMULATION):
            rows = slice(step * 16 + replica * 8, step * 16 + replica * 8 + 8)
            with tf.GradientTape() as tape:
                loss = loss_fn(y[rows], model(x[rows], training=True))
            grads = tape.gradient(loss, model.trainable_variables)
            grads = [np.asarray(g, "float64") for g in grads]
            total = (
                grads
                if total is None
                else [a + b for a, b in zip(total, grads)]
            )
        shares.append([g / (ACCUMULATION * 2) for g in total])
    return shares


def _by_shape(records: list) -> dict:
    return {(r["dtype"], r["shape"]): r["bytes"] for r in records}


def test_micro_steps_send_nothing(demo_runs):
    for name in DEMO_METHODS:
        assert demo_runs[name]["bytes_after_one_micro_step"] == 0, name


def test_float32_update_sends_the_parameters_once(demo_runs):
    records = demo_runs["float32"]["records"]
    # Every gradient once, plus the scalar "finite?" flag.
    assert sum(r["bytes"] for r in records) == 4 * DEMO_PARAMETERS + 4
    assert _by_shape(records)[("float32", ())] == 4


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_16_bit_floats_send_exactly_half_of_every_gradient(demo_runs, dtype):
    plain = _by_shape(demo_runs["float32"]["records"])
    for records in (
        demo_runs[dtype]["records"],
        demo_runs[dtype]["second_records"],
    ):
        sent = _by_shape(records)
        gradients = {s: b for (d, s), b in sent.items() if d == dtype}
        for (_, shape), size in plain.items():
            if shape:  # a gradient tensor
                assert gradients.pop(shape) * 2 == size, shape
        assert gradients == {}
        side = {k: b for k, b in sent.items() if k[0] != dtype}
        if dtype == "float16":
            # The scaling bound of each of the 10 tensors replaces the flag,
            # in one float32 all-reduce.
            assert side == {("float32", (10,)): 40}
        else:
            assert side == {}
        payload = sum(b for (d, _), b in sent.items() if d == dtype)
        assert payload * 2 == 4 * DEMO_PARAMETERS


def test_power_sgd_rank_2_sends_19x_fewer_bytes(demo_runs):
    for records in (
        demo_runs["power_sgd"]["records"],
        demo_runs["power_sgd"]["second_records"],
    ):
        assert {r["dtype"] for r in records} == {"float32"}
        total = sum(r["bytes"] for r in records)
        assert total == 4 * DEMO_POWER_SGD_ELEMENTS
        ratio = (4 * DEMO_PARAMETERS + 4) / total
        assert ratio > 19.0
        # No kernel crosses devices uncompressed (the inner optimizer's own
        # all-reduce is gone): only factors (rank 2) and biases.
        shapes = {r["shape"] for r in records}
        assert all(len(s) == 1 or s[-1] == 2 for s in shapes), shapes


@pytest.mark.parametrize(
    ("dtype", "roundoff"), [("float16", 2**-11), ("bfloat16", 2**-8)]
)
def test_first_update_within_rounding_of_the_mean_gradient(
    demo_runs, dtype, roundoff
):
    """|w_compressed - w_float32| <= lr * 2u * sum over replicas |share|
    (cast of each share, one addition), elementwise."""
    shares = demo_runs["shares"]
    largest = 0.0
    for index, (compressed, plain) in enumerate(
        zip(demo_runs[dtype]["first"], demo_runs["float32"]["first"])
    ):
        bound = np.abs(shares[0][index]) + np.abs(shares[1][index])
        difference = np.abs(compressed - plain)
        tolerance = LEARNING_RATE * 2.1 * roundoff * bound + 1e-7
        assert np.all(difference <= tolerance), index
        largest = max(largest, float(np.max(difference)))
    assert largest > 1e-9  # really rounded
    assert demo_runs[dtype]["replicas_agree"]


def test_power_sgd_first_update_is_a_low_rank_step(demo_runs):
    run, plain = demo_runs["power_sgd"], demo_runs["float32"]
    assert run["replicas_agree"]
    moved = [a - b for a, b in zip(run["first"], run["initial"])]
    moved_plain = [a - b for a, b in zip(plain["first"], plain["initial"])]
    # Biases (uncompressed) move exactly as with float32; each kernel's
    # step has rank <= 2.
    for step, step_plain in zip(moved, moved_plain):
        if step.ndim == 1:
            np.testing.assert_allclose(step, step_plain, atol=1e-7)
        else:
            matrix = step.reshape(-1, step.shape[-1])
            assert np.linalg.matrix_rank(matrix, tol=1e-6) <= 2


# ----------------------------------------------------------------------
# Strategies, clipping, delayed start
# ----------------------------------------------------------------------
def _mlp_run(strategy, compression, updates=2, accumulation=2, **kwargs):
    """The MLP under `strategy`, global micro-batches of 16; returns the
    loop, the bytes and the weights after each update."""
    inner_kwargs = kwargs.pop("inner_kwargs", {})
    loop = Loop(
        strategy,
        mlp,
        lambda: keras.optimizers.SGD(0.1, momentum=0.5, **inner_kwargs),
        compression,
        accumulation=accumulation,
        count_bytes=kwargs.pop("count_bytes", True),
        **kwargs,
    )
    x, y = regression(16 * accumulation * updates)
    per_update, weights = [], []
    for update in range(updates):
        for step in range(accumulation):
            start = (update * accumulation + step) * 16
            loop.micro_step(x[start : start + 16], y[start : start + 16])
        weights.append(loop.weights())
        if loop.counter is not None:
            per_update.append(loop.counter.total_bytes())
            loop.counter.reset()
    loop.close()
    return loop, per_update, weights


MLP_PARAMETERS = 12 * 32 + 32 + 32 * 32 + 32 + 32 + 1


@pytest.mark.parametrize("strategy_name", ["default", "one_device"])
def test_one_replica_is_a_no_op(strategy_name):
    strategy = make_strategy(strategy_name)
    _, _, plain = _mlp_run(strategy, None, count_bytes=False)
    for method in (
        "float16",
        "bfloat16",
        PowerSGD(rank=1, start_after_updates=0),
    ):
        _, _, weights = _mlp_run(strategy, method, count_bytes=False)
        for a, b in zip(weights[-1], plain[-1]):
            np.testing.assert_array_equal(a, b)


def _one_device_reference(inner_kwargs) -> list:
    """Plain SGD with momentum, default strategy, one step per 32 samples:
    the 2 micro-batches of 16 of each update (each split 8 / 8 between
    the replicas) together."""
    model = mlp()
    optimizer = keras.optimizers.SGD(0.1, momentum=0.5, **inner_kwargs)
    x, y = regression(64)
    loss_fn = keras.losses.MeanSquaredError()
    for start in (0, 32):
        with tf.GradientTape() as tape:
            rows = slice(start, start + 32)
            loss = loss_fn(y[rows], model(x[rows], training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
    return [np.array(w) for w in model.get_weights()]


CLIPPING = {"global_clipnorm": 0.05}


def test_clipping_under_replicas_reduces_once():
    """With clipping, the mean is all-reduced once, in the wrapper (no
    second all-reduce in the inner optimizer, no flag), and the inner
    optimizer clips the reduced mean, as on one device."""
    strategy = make_strategy("mirrored_2")
    _, per_update, weights = _mlp_run(strategy, None, inner_kwargs=CLIPPING)
    assert per_update == [4 * MLP_PARAMETERS] * 2
    for a, b in zip(weights[-1], _one_device_reference(CLIPPING)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_float16_with_clipping_stays_close_to_one_device():
    strategy = make_strategy("mirrored_2")
    _, per_update, weights = _mlp_run(
        strategy, "float16", inner_kwargs=CLIPPING
    )
    # float16 gradients, and the 6 tensors' float32 scaling bounds.
    assert per_update == [2 * MLP_PARAMETERS + 4 * 6] * 2
    for a, b in zip(weights[-1], _one_device_reference(CLIPPING)):
        np.testing.assert_allclose(a, b, atol=2e-4)


def test_start_after_updates_sends_float32_first():
    strategy = make_strategy("mirrored_2")
    method = PowerSGD(rank=1, start_after_updates=2)
    _, per_update, weights = _mlp_run(strategy, method, updates=3)
    _, plain_bytes, plain = _mlp_run(strategy, None, updates=2)
    # 2 updates in float32 (reduced in the wrapper: no flag), then
    # compressed: 12x32 and 32x32 as rank-1 factors, the rest as it is.
    assert per_update[:2] == [4 * MLP_PARAMETERS] * 2
    assert plain_bytes == [4 * MLP_PARAMETERS + 4] * 2
    compressed = (12 + 32) + (32 + 32) + 32 + 32 + 32 + 1
    assert per_update[2] == 4 * compressed
    for a, b in zip(weights[1], plain[1]):
        np.testing.assert_allclose(a, b, atol=1e-7)
    assert max(np.max(np.abs(a - b)) for a, b in zip(weights[2], weights[1]))


# ----------------------------------------------------------------------
# Mixed precision, sparse gradients
# ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "method", ["float16", PowerSGD(rank=1, start_after_updates=0)]
)
def test_nonfinite_window_on_one_replica_is_skipped(method):
    """mixed_float16, an overflow on replica 1 only: the window is skipped
    on both replicas and the compression state stays finite."""
    strategy = make_strategy("mirrored_2")
    x, y = regression(48, features=4)
    x[2 * 8 + 4 : 2 * 8 + 8] = 3.0e3  # replica 1 of micro-step 3
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            keras.utils.set_random_seed(4)
            model = keras.Sequential(
                [
                    keras.Input((4,)),
                    keras.layers.Dense(16, activation="relu"),
                    keras.layers.Dense(1, dtype="float32"),
                ]
            )
            model.compile(
                optimizer=GradientAccumulationOptimizer(
                    keras.optimizers.SGD(0.01), 2, compression=method
                ),
                loss="mse",
            )
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    wrapper = model.optimizer.inner_optimizer
    assert int(wrapper.skipped_updates.numpy()) == 1
    assert int(wrapper.iterations.numpy()) == 2
    state = [v for s in wrapper._compression_states for v in s]
    assert len(state) == (2 if isinstance(method, PowerSGD) else 0)
    for value in model.get_weights() + [np.asarray(v) for v in state]:
        assert np.all(np.isfinite(value))


def test_sparse_gradients_cross_uncompressed():
    strategy = make_strategy("mirrored_2")

    def model_fn():
        keras.utils.set_random_seed(3)
        return keras.Sequential(
            [
                keras.Input((3,), dtype="int32"),
                keras.layers.Embedding(40, 8),
                keras.layers.Flatten(),
                keras.layers.Dense(1),
            ]
        )

    rng = np.random.default_rng(2)
    x = rng.integers(0, 40, size=(16, 3)).astype("int32")
    y = rng.normal(size=(16, 1)).astype("float32")
    weights = {}
    for method in (None, "float16", PowerSGD(rank=1, start_after_updates=0)):
        loop = Loop(
            strategy, model_fn, lambda: keras.optimizers.SGD(0.5), method
        )
        loop.micro_step(x, y)
        weights[str(method)] = loop.weights()
        sparse = [r for r in loop.counter.records() if r["kind"] == "sparse"]
        assert [r["dtype"] for r in sparse] == ["float32"], method
        loop.close()
    # The table's update is the float32 one, whatever the method.
    for method in ("float16", str(PowerSGD(rank=1, start_after_updates=0))):
        np.testing.assert_allclose(
            weights[method][0], weights["None"][0], atol=1e-7
        )


# ----------------------------------------------------------------------
# State: resume mid-training with PowerSGD
# ----------------------------------------------------------------------
def _powersgd_model(strategy):
    with strategy.scope():
        model = mlp()
        schedule = keras.optimizers.schedules.ExponentialDecay(0.1, 1, 0.8)
        model.compile(
            optimizer=GradientAccumulationOptimizer(
                keras.optimizers.SGD(schedule, momentum=0.9),
                4,
                momentum_correction=True,
                compression=PowerSGD(rank=1, start_after_updates=0),
            ),
            loss="mse",
        )
    return model


def _fit_epoch(model):
    # 10 micro-batches of 8: the epoch ends 2 micro-batches into a window.
    x, y = regression(80)
    model.fit(x, y, batch_size=8, epochs=1, shuffle=False, verbose=0)


def _residual_total(model) -> float:
    states = model.optimizer._compression_states
    return sum(float(np.abs(np.asarray(s[0])).sum()) for s in states if s)


@pytest.mark.slow
def test_resume_mid_training_with_power_sgd(tmp_path):
    """`.keras` file and tf.train.Checkpoint, mid-window: the resumed run
    ends with the weights of the uninterrupted one, error feedback
    included (zeroing the restored residuals does not)."""
    strategy = make_strategy("mirrored_2")
    uninterrupted = _powersgd_model(strategy)
    _fit_epoch(uninterrupted)
    _fit_epoch(uninterrupted)
    expected = uninterrupted.get_weights()

    model = _powersgd_model(strategy)
    _fit_epoch(model)
    assert int(model.optimizer.pending_steps.numpy()) == 2
    assert _residual_total(model) > 0
    path = str(tmp_path / "model.keras")
    model.save(path)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    checkpoint_path = checkpoint.save(str(tmp_path / "ckpt"))

    with strategy.scope():
        loaded = keras.saving.load_model(path)
    assert loaded.optimizer.compression == PowerSGD(
        rank=1, start_after_updates=0
    )
    assert _residual_total(loaded) == pytest.approx(_residual_total(model))
    _fit_epoch(loaded)
    resumed = _powersgd_model(strategy)
    with strategy.scope():
        resumed.optimizer.build(resumed.trainable_variables)
    tf.train.Checkpoint(model=resumed, optimizer=resumed.optimizer).restore(
        checkpoint_path
    ).assert_consumed()
    _fit_epoch(resumed)
    for weights in (loaded.get_weights(), resumed.get_weights()):
        for a, b in zip(weights, expected):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    # The check can fail: without the residuals the run ends elsewhere.
    with strategy.scope():
        forgetful = keras.saving.load_model(path)
    for state in forgetful.optimizer._compression_states:
        if state:
            state[0].assign(tf.zeros_like(state[0]))
    _fit_epoch(forgetful)
    assert (
        max(
            np.max(np.abs(a - b))
            for a, b in zip(forgetful.get_weights(), expected)
        )
        > 1e-4
    )


# ----------------------------------------------------------------------
# Configuration and bad input
# ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "method",
    [
        None,
        "float16",
        "bfloat16",
        PowerSGD(rank=2, seed=3, start_after_updates=0),
    ],
)
def test_config_round_trip(method):
    optimizer = GradientAccumulationOptimizer(
        keras.optimizers.SGD(0.1), 2, compression=method
    )
    config = optimizer.get_config()
    restored = GradientAccumulationOptimizer.from_config(config)
    assert restored.compression == optimizer.compression
    again = keras.optimizers.deserialize(keras.optimizers.serialize(optimizer))
    assert again.compression == optimizer.compression


@pytest.mark.parametrize(
    ("compression", "error", "message"),
    [
        ("float8", ValueError, r"Received: compression='float8'"),
        ("PowerSGD", ValueError, r"Argument `compression` must be one of"),
        (2, TypeError, r"Received: compression=2 \(of type int\)"),
    ],
)
def test_unknown_method(compression, error, message):
    with pytest.raises(error, match=message):
        GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1), 2, compression=compression
        )


@pytest.mark.parametrize(
    "compression", ["bfloat16", PowerSGD(rank=1, start_after_updates=0)]
)
def test_strategy_that_does_not_all_reduce(compression):
    strategy = make_strategy("central_storage")
    with strategy.scope():
        with pytest.raises(
            ValueError,
            match=r"needs a strategy that all-reduces gradients between "
            r"replicas, but the optimizer is created under "
            r"CentralStorageStrategy",
        ):
            GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.1), 2, compression=compression
            )
        # Without compression it is fine.
        GradientAccumulationOptimizer(keras.optimizers.SGD(0.1), 2)

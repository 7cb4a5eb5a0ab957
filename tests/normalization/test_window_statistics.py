"""use_window_statistics: BatchNormalization moving statistics that advance
once per optimizer update, compared with the large batch; written once and
run on each backend.

Reference: the same model trained on the large batch (K micro-batches in one
step) on one device with the plain optimizer. Where the micro-batches see
what the large batch would (K copies of one micro-batch, or
BatchNormalization first), the window's moving statistics must equal the
large batch's. Accumulation is keras_mgpu's GradientAccumulationOptimizer on
TensorFlow and Keras's own `gradient_accumulation_steps` on JAX (the window
reads either, through `accumulation_steps` or `gradient_accumulation_steps`).
Under distribution: a 2-replica MirroredStrategy (per-replica and
synchronized statistics) on TensorFlow, `DataParallel` over 4 devices (the
global micro-batch's statistics) on JAX.
"""

from __future__ import annotations

import functools
import inspect
import os

import numpy as np
import pytest
from _batchnorm_checks import max_diff, moving

from keras_mgpu import _flavour
from keras_mgpu.normalization import (
    batchnorm_layers,
    restore_batchnorm_statistics,
    use_window_statistics,
)
from keras_mgpu.normalization._find import choice_of, mark_choice
from keras_mgpu.normalization.window_statistics import (
    window_batch_normalization_class,
    window_state,
)
from keras_mgpu.optimizers import GradientAccumulationOptimizer
from keras_mgpu.testing import set_random_seed

if _flavour.IS_TF_KERAS:  # tests/legacy/normalization covers tf_keras
    pytest.skip("Keras 3 tests", allow_module_level=True)

pytestmark = pytest.mark.backends("tensorflow", "jax")

keras = _flavour.keras
ON_JAX = keras.backend.backend() == "jax"

K = 4
MICRO = 8
RNG = np.random.default_rng(0)
# Far from the initial moving statistics (0 and 1), so drift shows.
X_MICRO = (RNG.normal(size=(MICRO, 6)) * 2.0 + 1.0).astype("float32")
Y_MICRO = RNG.normal(size=(MICRO, 1)).astype("float32")


def deep_model() -> keras.Model:
    """Dense -> BN -> Dense -> BN -> Dense, same weights for a seed."""
    set_random_seed(7)
    return keras.Sequential(
        [
            keras.Input((6,)),
            # No bias before BatchNormalization: its gradient is rounding
            # noise, which Adam would blow up to steps of the learning rate.
            keras.layers.Dense(5, use_bias=False),
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.Dense(4, activation="relu", use_bias=False),
            keras.layers.BatchNormalization(momentum=0.8),
            keras.layers.Dense(1),
        ]
    )


def first_bn_model() -> keras.Model:
    """BatchNormalization directly after the input (functional)."""
    set_random_seed(7)
    inputs = keras.Input((6,))
    hidden = keras.layers.BatchNormalization(momentum=0.9)(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def trainable(model) -> list:
    return [np.array(v) for v in model.trainable_variables]


def make_optimizer(name: str, accumulate: int | None):
    """Plain SGD or Adam; with `accumulate`, accumulating over that many
    micro-batches: keras_mgpu's GradientAccumulationOptimizer on
    TensorFlow, Keras's own `gradient_accumulation_steps` on JAX."""
    kind, rate = (
        (keras.optimizers.SGD, 0.1)
        if name == "sgd"
        else (keras.optimizers.Adam, 0.01)
    )
    if accumulate is None:
        return kind(rate)
    if ON_JAX:
        return kind(rate, gradient_accumulation_steps=accumulate)
    return GradientAccumulationOptimizer(
        kind(rate), accumulation_steps=accumulate
    )


def fit_large(build, x, y, optimizer: str = "sgd", batch: int = MICRO * K):
    model = build()
    model.compile(make_optimizer(optimizer, None), "mse")
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return model


def fit_micro(build, x, y, statistics, optimizer="sgd", batch=MICRO):
    model = build()
    if statistics is not None:
        use_window_statistics(model, window=K, statistics=statistics)
    model.compile(make_optimizer(optimizer, K), "mse")
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return model


UPDATES = 2
X_COPIES = np.concatenate([X_MICRO] * (K * UPDATES))
Y_COPIES = np.concatenate([Y_MICRO] * (K * UPDATES))


@functools.cache
def copies_run(statistics, optimizer: str = "sgd") -> dict:
    """deep_model trained on X_COPIES: on the large batch (`statistics`
    "large") or accumulated over micro-batches with `statistics`; its
    trainable weights, moving statistics, first window state and choice.
    Cached: two tests compare with the same runs (arrays only, so Keras's
    session may be cleared in between)."""
    if statistics == "large":
        model = fit_large(deep_model, X_COPIES, Y_COPIES, optimizer)
    else:
        model = fit_micro(deep_model, X_COPIES, Y_COPIES, statistics, optimizer)
    first = batchnorm_layers(model)[0]
    state = None
    if statistics == "window":
        state = [np.array(v) for v in window_state(first)]
    return {
        "trainable": trainable(model),
        "moving": moving(model),
        "state": state,
        "choice": choice_of(first),
    }


@pytest.mark.parametrize(
    "optimizer",
    ["sgd", pytest.param("adam", marks=pytest.mark.backends("tensorflow"))],
)
def test_equals_the_large_batch_when_micro_batches_match_it(optimizer):
    # Each micro-batch is the same block, so it has the large batch's
    # statistics and normalisation noise vanishes: weights and moving
    # statistics of the accumulated run must be the large batch's.
    large = copies_run("large", optimizer)
    runs = {
        statistics: copies_run(statistics, optimizer)
        for statistics in (None, "window", "momentum")
    }
    for statistics in ("window", "momentum"):
        run = runs[statistics]
        assert max_diff(run["trainable"], large["trainable"]) < 1e-5
        assert max_diff(run["moving"], large["moving"]) < 1e-5, statistics
        assert run["choice"] == statistics
    # Without a remedy the statistics move K times per update.
    assert max_diff(runs[None]["trainable"], large["trainable"]) < 1e-5
    assert max_diff(runs[None]["moving"], large["moving"]) > 0.1


def test_window_is_exact_on_random_data_with_uneven_micro_batches():
    # BatchNormalization first: every micro-batch reaches it as the large
    # batch would. 30 examples in micro-batches of 8, 8, 8, 6: one update.
    x = (RNG.normal(size=(30, 6)) * 3.0 + 2.0).astype("float32")
    y = RNG.normal(size=(30, 1)).astype("float32")
    large = moving(fit_large(first_bn_model, x, y, batch=30))
    errors = {
        statistics: max_diff(
            moving(fit_micro(first_bn_model, x, y, statistics)), large
        )
        for statistics in (None, "window", "momentum")
    }
    assert errors["window"] < 1e-5
    # The momentum correction misses the variance between micro-batches.
    assert errors["momentum"] > 1e-3
    assert errors["momentum"] < errors[None]


@pytest.mark.parametrize("mode", ["jit_compile", "run_eagerly"])
def test_window_is_exact_under_xla_and_eagerly(mode):
    # BatchNormalization first: its statistics depend on the data only, so
    # plain SGD (updating every step) does not disturb them.
    x = (RNG.normal(size=(32, 6)) * 3.0 + 2.0).astype("float32")
    y = RNG.normal(size=(32, 1)).astype("float32")
    runs = []
    for statistics, batch in ((None, 32), ("window", MICRO)):
        model = first_bn_model()
        if statistics is not None:
            use_window_statistics(model, window=K)
        model.compile(keras.optimizers.SGD(0.1), "mse", **{mode: True})
        model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
        runs.append(moving(model))
    assert max_diff(runs[1], runs[0]) < 1e-5


@pytest.mark.backends("tensorflow")
@pytest.mark.parametrize("switch", ["after_placement", "before_placement"])
def test_pipeline_micro_batches_with_window_equal_the_large_batch(switch):
    import tensorflow as tf

    from keras_mgpu.placement import apply_placement

    devices = [d.name for d in tf.config.list_logical_devices("CPU")][:2]
    x = (RNG.normal(size=(32, 6)) * 3.0 + 2.0).astype("float32")
    y = RNG.normal(size=(32, 1)).astype("float32")

    def placed_model(window=None):
        set_random_seed(7)
        inputs = keras.Input((6,))
        hidden = keras.layers.BatchNormalization(momentum=0.9)(inputs)
        hidden = keras.layers.Dense(5)(hidden)
        model = keras.Model(inputs, keras.layers.Dense(1)(hidden))
        if window and switch == "before_placement":
            # The placed copy is made from the config: switched and marked.
            use_window_statistics(model, window=window)
        placed = apply_placement(model, devices, micro_batches=4)
        if window and switch == "after_placement":
            use_window_statistics(placed, window=window)
        return placed

    large = moving(fit_large(first_bn_model, x, y, batch=32))
    plain = placed_model()
    windowed = placed_model(window=4)
    assert [choice_of(x) for x in batchnorm_layers(windowed)] == ["window"]
    for model in (plain, windowed):
        model.compile(keras.optimizers.SGD(0.1), "mse")
        model.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    assert max_diff(moving(windowed), large) < 1e-5
    assert max_diff(moving(plain), large) > 1e-2


@pytest.mark.backends("tensorflow")
def test_mirrored_two_replicas(mirrored_strategy, tmp_path):
    # Every micro-batch is one block of 4 rows twice: each replica's share
    # is that block, whose statistics are the large batch's, so each
    # replica's moving statistics must be the large batch's.
    block = X_MICRO[:4]
    x = np.concatenate([block] * (2 * K * 2))
    y = np.concatenate([Y_MICRO[:4]] * (2 * K * 2))
    large = moving(fit_large(first_bn_model, x, y, batch=8 * K))
    strategy = mirrored_strategy(2)
    with strategy.scope():
        model = first_bn_model()
        model.compile(make_optimizer("sgd", K), "mse")
    # Outside the scope: the accumulators go where the statistics are.
    use_window_statistics(model, window=K)
    layer = batchnorm_layers(model)[0]
    for variable in window_state(layer):
        assert len(variable.value.values) == 2
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    for variable in (layer.moving_mean, layer.moving_variance):
        values = [np.array(v) for v in variable.value.values]
        assert len(values) == 2
        for value in values:
            assert np.all(np.isfinite(value))
    assert max_diff(moving(model), large) < 1e-5
    assert np.array(window_state(layer)[0]) == 0  # two full windows
    # Mid-window `.keras` round trip under the strategy.
    model.fit(x[:8], y[:8], batch_size=8, shuffle=False, verbose=0)
    path = os.path.join(tmp_path, "mirrored.keras")
    model.save(path)
    with strategy.scope():
        loaded = keras.models.load_model(path)
    assert np.array(window_state(batchnorm_layers(loaded)[0])[0]) == 1
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))


@pytest.mark.backends("tensorflow")
def test_synchronized_and_window_equal_the_global_large_batch(
    mirrored_strategy,
):
    # synchronized=True: each micro-batch's statistics are global, so the
    # window is the global large batch's, on random data.
    x = (RNG.normal(size=(64, 6)) * 3.0 + 2.0).astype("float32")
    y = RNG.normal(size=(64, 1)).astype("float32")
    large = moving(fit_large(first_bn_model, x, y, batch=8 * K))
    with mirrored_strategy(2).scope():
        set_random_seed(7)
        inputs = keras.Input((6,))
        layer = keras.layers.BatchNormalization(momentum=0.9, synchronized=True)
        outputs = keras.layers.Dense(1)(layer(inputs))
        model = use_window_statistics(keras.Model(inputs, outputs), window=K)
        model.compile(make_optimizer("sgd", K), "mse")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    replicas = [np.array(v) for v in layer.moving_variance.value.values]
    assert max_diff(replicas, [large[1], large[1]]) < 1e-5
    assert max_diff(moving(model), large) < 1e-5


def test_keras_file_round_trip_resumes_mid_window(tmp_path):
    x = np.concatenate([X_MICRO[::-1], X_MICRO] * K)
    y = np.concatenate([Y_MICRO[::-1], Y_MICRO] * K)
    uninterrupted = fit_micro(deep_model, x, y, "window")

    model = deep_model()
    use_window_statistics(model, window=K)
    model.compile(make_optimizer("sgd", K), "mse")
    model.fit(x[:24], y[:24], batch_size=MICRO, shuffle=False, verbose=0)
    layer = batchnorm_layers(model)[0]
    assert np.array(window_state(layer)[0]) == 3  # mid-window
    path = os.path.join(tmp_path, "window.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    loaded_layer = batchnorm_layers(loaded)[0]
    assert type(loaded_layer) is window_batch_normalization_class()
    config = loaded_layer.get_config()
    assert (config["window"], config["statistics"]) == (K, "window")
    assert config["momentum"] == 0.9
    for a, b in zip(model.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    # Switching again as it is keeps the window in progress.
    use_window_statistics(loaded, window=K)
    assert np.array(window_state(loaded_layer)[0]) == 3
    # The accumulation's own counter and sums are optimizer state: loaded
    # too (keras_mgpu's optimizer on TensorFlow, Keras's on JAX).
    loaded.fit(x[24:], y[24:], batch_size=MICRO, shuffle=False, verbose=0)
    for a, b in zip(loaded.weights, uninterrupted.weights, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-6)


def test_weights_checkpoint_resumes_mid_window(tmp_path):
    # Plain SGD at learning rate 0: only the statistics move, so the
    # checkpoint of the model alone carries everything that matters.
    x = (RNG.normal(size=(48, 6)) * 3.0 + 2.0).astype("float32")
    y = RNG.normal(size=(48, 1)).astype("float32")

    def build():
        model = use_window_statistics(first_bn_model(), window=K)
        model.compile(keras.optimizers.SGD(0.0), "mse")
        return model

    uninterrupted = build()
    uninterrupted.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    first = build()
    first.fit(x[:16], y[:16], batch_size=MICRO, shuffle=False, verbose=0)
    path = os.path.join(tmp_path, "mid.weights.h5")
    first.save_weights(path)
    resumed = build()
    resumed.load_weights(path)
    resumed.fit(x[16:], y[16:], batch_size=MICRO, shuffle=False, verbose=0)
    assert max_diff(moving(resumed), moving(uninterrupted)) < 1e-6


def test_backup_and_restore_resumes_mid_window(tmp_path):
    # 6 micro-batches per epoch, windows of 4: the epoch's backup is taken
    # mid-window, with the accumulation optimizer mid-window too.
    x = np.concatenate([X_MICRO[::-1], X_MICRO, X_MICRO * 0.5] * 2)
    y = np.concatenate([Y_MICRO[::-1], Y_MICRO, Y_MICRO] * 2)

    def build():
        model = use_window_statistics(deep_model(), window=K)
        model.compile(make_optimizer("sgd", K), "mse")
        return model

    def train(model, callbacks):
        model.fit(
            x,
            y,
            batch_size=MICRO,
            epochs=2,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )

    class Interrupt(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 1:
                raise RuntimeError("interrupted")

    uninterrupted = build()
    train(uninterrupted, [])
    backup = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(RuntimeError, match="interrupted"):
        train(build(), [backup, Interrupt()])
    resumed = build()
    train(resumed, [keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))])
    for a, b in zip(resumed.weights, uninterrupted.weights, strict=True):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-6)


def test_restore_gives_back_the_plain_layer():
    model = deep_model()
    configs = [layer.get_config() for layer in batchnorm_layers(model)]
    use_window_statistics(model, window=K)
    assert [choice_of(layer) for layer in batchnorm_layers(model)] == [
        "window",
        "window",
    ]
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(X_COPIES[:16], Y_COPIES[:16], batch_size=MICRO, verbose=0)
    restore_batchnorm_statistics(model)
    layers = batchnorm_layers(model)
    assert all(type(x) is keras.layers.BatchNormalization for x in layers)
    assert [x.get_config() for x in layers] == configs
    assert [choice_of(x) for x in layers] == [None, None]
    assert len(model.weights) == 12
    assert len(model.non_trainable_weights) == 4  # no window state left
    # Saved now, the model loads without keras_mgpu.
    assert "keras_mgpu" not in model.to_json()
    # Plain behaviour again: statistics move on every call, as a fresh
    # plain model from the same state moves them.
    plain = deep_model()
    plain.set_weights(model.get_weights())
    for candidate in (model, plain):
        candidate.compile(keras.optimizers.SGD(0.1), "mse")
        candidate.fit(X_MICRO, Y_MICRO, batch_size=MICRO, verbose=0)
    # Bit for bit on TensorFlow; on JAX XLA compiles the two models' steps
    # apart and may round one of them differently (measured: 2.4e-7).
    np.testing.assert_allclose(
        np.concatenate([m.ravel() for m in moving(model)]),
        np.concatenate([m.ravel() for m in moving(plain)]),
        rtol=0,
        atol=1e-6 if ON_JAX else 0,
    )


def test_layers_frozen_by_choice_are_left_alone():
    model = deep_model()
    first, second = batchnorm_layers(model)
    mark_choice(second, "frozen")
    use_window_statistics(model, window=K, statistics="momentum")
    assert [choice_of(first), choice_of(second)] == ["momentum", "frozen"]
    assert type(second) is keras.layers.BatchNormalization
    assert first.momentum == pytest.approx(0.9 ** (1 / K))
    assert first.get_config()["momentum"] == 0.9
    restore_batchnorm_statistics(model)
    assert [choice_of(first), choice_of(second)] == [None, "frozen"]
    assert first.momentum == 0.9


def test_switch_after_compile_and_fit_is_picked_up():
    model = first_bn_model()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(X_MICRO, Y_MICRO, batch_size=MICRO, verbose=0)
    before = moving(model)
    use_window_statistics(model, window=K)
    # K - 1 micro-batches: the window is not complete, nothing moves.
    model.fit(X_COPIES[:24], Y_COPIES[:24], batch_size=MICRO, verbose=0)
    assert max_diff(moving(model), before) == 0.0
    model.fit(X_COPIES[:8], Y_COPIES[:8], batch_size=MICRO, verbose=0)
    assert max_diff(moving(model), before) > 1e-2


@pytest.mark.parametrize("order", ["recompute_first", "window_first"])
def test_composes_with_recompute_in_place(order):
    from keras_mgpu.layers import apply_recompute

    alone = copies_run("window")

    model = deep_model()
    if order == "recompute_first":
        apply_recompute(model, in_place=True)
    use_window_statistics(model, window=K)
    if order == "window_first":
        apply_recompute(model, in_place=True)
    model.compile(make_optimizer("sgd", K), "mse")
    model.fit(X_COPIES, Y_COPIES, batch_size=MICRO, shuffle=False, verbose=0)
    assert max_diff(moving(model), alone["moving"]) < 1e-6
    assert max_diff(trainable(model), alone["trainable"]) < 1e-6
    state = [np.array(v) for v in window_state(batchnorm_layers(model)[0])]
    assert max_diff(state, alone["state"]) < 1e-6


# The switch is backend-independent; the eager steps are not cheap on JAX,
# which compiles each op of an eager step (MobileNetV2: minutes on 2 cores).
@pytest.mark.backends("tensorflow")
@pytest.mark.slow
def test_applications_model():
    model = keras.applications.MobileNetV2(
        input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=3
    )
    count = len(batchnorm_layers(model))
    optimizer = make_optimizer("sgd", 2)
    use_window_statistics(model, optimizer=optimizer)
    layers = batchnorm_layers(model)
    assert count == len(layers) > 30
    assert all(choice_of(layer) == "window" for layer in layers)
    # Eager: tracing MobileNetV2 takes 20-30 s on 2 cores, 2 eager steps 5.
    model.compile(
        optimizer, "sparse_categorical_crossentropy", run_eagerly=True
    )
    x = RNG.normal(size=(8, 32, 32, 3)).astype("float32")
    y = RNG.integers(0, 3, size=(8,))
    model.fit(x, y, batch_size=4, verbose=0)
    assert np.all(np.isfinite(np.array(model(x[:2], training=False))))
    assert all(np.array(window_state(x)[0]) == 0 for x in layers)
    restore_batchnorm_statistics(model)
    assert all(type(x) is keras.layers.BatchNormalization for x in layers)


def test_unbuilt_sequential():
    unbuilt = keras.Sequential(
        [keras.layers.Dense(3), keras.layers.BatchNormalization()]
    )
    use_window_statistics(unbuilt, window=2, statistics="window")
    unbuilt.compile("sgd", "mse")
    unbuilt.fit(X_MICRO, Y_MICRO.repeat(3, axis=1), batch_size=4, verbose=0)
    assert np.array(window_state(unbuilt.layers[1])[0]) == 0


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"window": 0}, ValueError, "`window` must be an integer >= 1"),
        ({"window": 1.5}, TypeError, "`window` must be an integer"),
        ({"window": "2"}, TypeError, "Received: window='2'"),
        ({}, ValueError, "Pass `window`"),
        ({"window": 2, "statistics": "bogus"}, ValueError, "statistics='bog"),
        ({"optimizer": "sgd"}, TypeError, "`optimizer` must be a keras_mgpu"),
        # A Keras optimizer without accumulation (built in the test).
        ({"optimizer": None}, TypeError, "with `gradient_accumulation_steps`"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    if "optimizer" in kwargs and kwargs["optimizer"] is None:
        kwargs = {"optimizer": keras.optimizers.SGD(0.1)}
    with pytest.raises(error, match=match):
        use_window_statistics(first_bn_model(), **kwargs)


def test_bad_models():
    with pytest.raises(TypeError, match="`model` must be a Keras model"):
        use_window_statistics("model", window=2)
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.raises(ValueError, match="has no BatchNormalization layer"):
        use_window_statistics(plain, window=2)
    inputs = keras.Input((3,))
    # Keras 3.10 (the floor) has no `renorm`; 3.15 has.
    if (
        "renorm"
        in inspect.signature(keras.layers.BatchNormalization).parameters
    ):
        renorm = keras.Model(
            inputs, keras.layers.BatchNormalization(renorm=True)(inputs)
        )
        with pytest.raises(ValueError, match="renorm=True"):
            use_window_statistics(renorm, window=2)
    both = make_optimizer("sgd", 2)
    with pytest.raises(ValueError, match="either `window` or `optimizer`"):
        use_window_statistics(first_bn_model(), window=2, optimizer=both)


# ----------------------------------------------------------------------
# JAX: keras.distribution
# ----------------------------------------------------------------------
# BatchNormalization first: each micro-batch reaches it as the large batch
# would, so the window's statistics must be the large batch's on any data.
_RANDOM = np.random.default_rng(1)
X_RANDOM = (_RANDOM.normal(size=(30, 6)) * 3.0 + 2.0).astype("float32")
Y_RANDOM = _RANDOM.normal(size=(30, 1)).astype("float32")


@pytest.mark.backends("jax")
def test_data_parallel_window_equals_one_device_large_batch():
    # Global micro-batches of 8 on 4 devices (2 rows each), window 4, vs
    # one device's batch of 32: XLA's step computes each micro-batch's
    # statistics over the global micro-batch.
    x = np.concatenate([X_RANDOM[:24], X_RANDOM[:8]])
    y = np.concatenate([Y_RANDOM[:24], Y_RANDOM[:8]])
    large = moving(fit_large(first_bn_model, x, y, batch=32))
    devices = keras.distribution.list_devices("cpu")
    distribution = keras.distribution.DataParallel(devices=devices)
    with distribution.scope():
        model = first_bn_model()
    # Switched outside the scope: the accumulators take the moving
    # statistics' layout (replicated over the 4 devices).
    use_window_statistics(model, window=K)
    calls = window_state(batchnorm_layers(model)[0])[0]
    assert len(calls.value.sharding.device_set) == 4
    with distribution.scope():
        model.compile(make_optimizer("sgd", K), "mse")
        model.fit(x, y, batch_size=MICRO, shuffle=False, verbose=0)
    assert max_diff(moving(model), large) < 1e-5


@pytest.mark.backends("jax")
@pytest.mark.keras_limit
def test_data_parallel_refuses_a_batch_that_does_not_split_evenly():
    # Keras 3.15 on JAX: the last batch of 29 examples in batches of 8 (5
    # rows) cannot be sharded over 4 devices, so an uneven split never
    # reaches the window (on TensorFlow synchronised windows weigh it by
    # its global size). Fails when Keras shards (or pads) such a batch.
    distribution = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices("cpu")
    )
    with distribution.scope():
        model = use_window_statistics(first_bn_model(), window=K)
        model.compile(make_optimizer("sgd", K), "mse")
        with pytest.raises(Exception, match="evenly divide") as raised:
            model.fit(
                X_RANDOM[:29],
                Y_RANDOM[:29],
                batch_size=MICRO,
                shuffle=False,
                verbose=0,
            )
    assert type(raised.value).__name__ == "IndivisibleError"

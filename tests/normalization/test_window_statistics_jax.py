"""use_window_statistics on Keras's JAX backend, against the large batch.

Reference: the same model trained on the large batch (K micro-batches in one
step) on one device with plain SGD. Accumulation here is Keras's own
`gradient_accumulation_steps` (keras_mgpu's GradientAccumulationOptimizer is
read the same way, through its `accumulation_steps`).
"""

from __future__ import annotations

import os

import keras
import numpy as np
import pytest
from _batchnorm_checks import max_diff, moving

from keras_mgpu.normalization import (
    batchnorm_layers,
    restore_batchnorm_statistics,
    use_window_statistics,
)
from keras_mgpu.normalization._find import choice_of
from keras_mgpu.normalization.window_statistics import (
    window_batch_normalization_class,
    window_state,
)

K = 4
MICRO = 8
RNG = np.random.default_rng(0)
X_MICRO = (RNG.normal(size=(MICRO, 6)) * 2.0 + 1.0).astype("float32")
Y_MICRO = RNG.normal(size=(MICRO, 1)).astype("float32")
UPDATES = 2
X_COPIES = np.concatenate([X_MICRO] * (K * UPDATES))
Y_COPIES = np.concatenate([Y_MICRO] * (K * UPDATES))
# BatchNormalization first: each micro-batch reaches it as the large batch
# would, so the window's statistics must be the large batch's on any data.
X_RANDOM = (RNG.normal(size=(30, 6)) * 3.0 + 2.0).astype("float32")
Y_RANDOM = RNG.normal(size=(30, 1)).astype("float32")


def deep_model() -> keras.Model:
    keras.utils.set_random_seed(7)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(4, use_bias=False),
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.Dense(4, activation="relu", use_bias=False),
            keras.layers.BatchNormalization(momentum=0.8),
            keras.layers.Dense(1),
        ]
    )


def first_bn_model() -> keras.Model:
    keras.utils.set_random_seed(7)
    inputs = keras.Input((6,))
    hidden = keras.layers.BatchNormalization(momentum=0.9)(inputs)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def trainable(model) -> list:
    return [np.array(v) for v in model.trainable_variables]


def fit(model, x, y, batch, accumulate=None):
    optimizer = keras.optimizers.SGD(
        0.1, gradient_accumulation_steps=accumulate
    )
    model.compile(optimizer, "mse")
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return model


@pytest.fixture(scope="module")
def large_copies():
    return fit(deep_model(), X_COPIES, Y_COPIES, MICRO * K)


@pytest.mark.slow
def test_window_equals_the_large_batch_with_keras_accumulation(large_copies):
    # Every micro-batch is one block: the large batch's statistics, so the
    # accumulated run's weights and moving statistics must be the large
    # batch's; unremedied, the statistics move K times per update.
    runs = {}
    for statistics in (None, "window", "momentum"):
        model = deep_model()
        optimizer = keras.optimizers.SGD(0.1, gradient_accumulation_steps=K)
        if statistics is not None:
            use_window_statistics(
                model, optimizer=optimizer, statistics=statistics
            )
        model.compile(optimizer, "mse")
        model.fit(
            X_COPIES, Y_COPIES, batch_size=MICRO, shuffle=False, verbose=0
        )
        runs[statistics] = model
    for statistics in ("window", "momentum"):
        model = runs[statistics]
        assert max_diff(trainable(model), trainable(large_copies)) < 1e-5
        assert max_diff(moving(model), moving(large_copies)) < 1e-5
        assert choice_of(batchnorm_layers(model)[0]) == statistics
    assert max_diff(moving(runs[None]), moving(large_copies)) > 0.1


def test_window_is_exact_on_random_data_with_uneven_micro_batches():
    # 30 examples in micro-batches 8, 8, 8, 6: one window, one update.
    large = moving(fit(first_bn_model(), X_RANDOM, Y_RANDOM, 30))
    model = use_window_statistics(first_bn_model(), window=K)
    fit(model, X_RANDOM, Y_RANDOM, MICRO, accumulate=K)
    assert max_diff(moving(model), large) < 1e-5


def test_data_parallel_window_equals_one_device_large_batch():
    # Global micro-batches of 8 on 4 devices (2 rows each), window 4, vs
    # one device's batch of 32: XLA's step computes each micro-batch's
    # statistics over the global micro-batch.
    x, y = X_RANDOM[:24], Y_RANDOM[:24]
    x = np.concatenate([x, X_RANDOM[:8]])
    y = np.concatenate([y, Y_RANDOM[:8]])
    large = moving(fit(first_bn_model(), x, y, 32))
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
        fit(model, x, y, MICRO, accumulate=K)
    assert max_diff(moving(model), large) < 1e-5


def test_keras_file_round_trip_resumes_mid_window(tmp_path):
    x = np.concatenate([X_MICRO[::-1], X_MICRO] * (K // 2))
    y = np.concatenate([Y_MICRO[::-1], Y_MICRO] * (K // 2))
    uninterrupted = use_window_statistics(first_bn_model(), window=K)
    fit(uninterrupted, x, y, MICRO, accumulate=K)

    model = use_window_statistics(first_bn_model(), window=K)
    fit(model, x[:24], y[:24], MICRO, accumulate=K)
    layer = batchnorm_layers(model)[0]
    assert int(np.array(window_state(layer)[0])) == 3  # mid-window
    path = os.path.join(tmp_path, "window.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    loaded_layer = batchnorm_layers(loaded)[0]
    assert type(loaded_layer) is window_batch_normalization_class()
    assert int(np.array(window_state(loaded_layer)[0])) == 3
    # Keras's accumulation counter is optimizer state: load it too.
    loaded.fit(x[24:], y[24:], batch_size=MICRO, shuffle=False, verbose=0)
    assert max_diff(moving(loaded), moving(uninterrupted)) < 1e-6


def test_restore_and_bad_optimizer():
    model = use_window_statistics(first_bn_model(), window=K)
    assert len(model.non_trainable_weights) == 2 + 4
    restore_batchnorm_statistics(model)
    assert type(model.layers[1]) is keras.layers.BatchNormalization
    assert len(model.non_trainable_weights) == 2
    with pytest.raises(TypeError, match="gradient_accumulation_steps"):
        use_window_statistics(model, optimizer=keras.optimizers.SGD(0.1))


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
        model.compile(
            keras.optimizers.SGD(0.1, gradient_accumulation_steps=K), "mse"
        )
        with pytest.raises(Exception, match="evenly divide") as raised:
            model.fit(
                X_RANDOM[:29],
                Y_RANDOM[:29],
                batch_size=MICRO,
                shuffle=False,
                verbose=0,
            )
    assert type(raised.value).__name__ == "IndivisibleError"

"""tf_keras: use_window_statistics moves BatchNormalization statistics once
per optimizer update, as the large batch would (fused 4-D kernel and the
plain path), round-trips through `.keras` files mid-window and undoes.

Reference: the same model trained on the large batch with the plain
optimizer (see tests/normalization/test_window_statistics.py).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _batchnorm_checks import max_diff, moving
from conftest import make_strategy

from keras_mgpu._flavour import keras
from keras_mgpu.layers import apply_recompute
from keras_mgpu.normalization import (
    batchnorm_layers,
    restore_batchnorm_statistics,
    use_window_statistics,
)
from keras_mgpu.normalization.window_statistics import (
    window_batch_normalization_class,
    window_state,
)
from keras_mgpu.optimizers import GradientAccumulationOptimizer

K = 4
MICRO = 8
RNG = np.random.default_rng(0)


def dense_model():
    keras.utils.set_random_seed(7)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(5, use_bias=False),
            keras.layers.BatchNormalization(momentum=0.9),
            keras.layers.Dense(1),
        ]
    )


def conv_model():
    # 4-D input: tf_keras runs its fused kernel (Bessel-corrected inside).
    keras.utils.set_random_seed(7)
    inputs = keras.Input((4, 4, 2))
    hidden = keras.layers.BatchNormalization(momentum=0.9)(inputs)
    hidden = keras.layers.GlobalAveragePooling2D()(hidden)
    return keras.Model(inputs, keras.layers.Dense(1)(hidden))


def fit(
    build, x, y, statistics, batch, accumulate=True, before=None, jit=False
):
    model = build()
    if before is not None:
        before(model)
    if statistics is not None:
        use_window_statistics(model, window=K, statistics=statistics)
    optimizer = keras.optimizers.SGD(0.1)
    if accumulate:
        optimizer = GradientAccumulationOptimizer(optimizer, K)
    model.compile(optimizer, "mse", jit_compile=jit)
    model.fit(x, y, batch_size=batch, shuffle=False, verbose=0)
    return model


def test_equals_the_large_batch_when_micro_batches_match_it():
    block = (RNG.normal(size=(MICRO, 6)) * 2.0 + 1.0).astype("float32")
    x = np.concatenate([block] * (3 * K))
    y = np.concatenate([RNG.normal(size=(MICRO, 1)).astype("float32")] * 12)
    large = fit(dense_model, x, y, None, MICRO * K, accumulate=False)
    runs = {s: fit(dense_model, x, y, s, MICRO) for s in (None, "window")}
    runs["momentum"] = fit(dense_model, x, y, "momentum", MICRO)
    for statistics in ("window", "momentum"):
        model = runs[statistics]
        assert max_diff(model.get_weights()[:1], large.get_weights()[:1]) < (
            1e-5
        )
        assert max_diff(moving(model), moving(large)) < 1e-5, statistics
    assert max_diff(moving(runs[None]), moving(large)) > 0.1


@pytest.mark.parametrize(
    "build, shape, jit",
    [
        (dense_model, (6,), False),
        (conv_model, (4, 4, 2), False),
        # XLA takes another branch of tf_keras's fused path.
        (conv_model, (4, 4, 2), True),
    ],
)
def test_window_is_exact_on_random_data(build, shape, jit):
    # BatchNormalization first: its statistics depend on the data only, so
    # the micro-batch runs may even update the weights every step (XLA
    # cannot compile the accumulation's replica-context decisions).
    x = (RNG.normal(size=(30, *shape)) * 3.0 + 2.0).astype("float32")
    y = RNG.normal(size=(30, 1)).astype("float32")
    large = moving(fit(build, x, y, None, 30, accumulate=False, jit=jit))
    plain = moving(fit(build, x, y, None, MICRO, not jit, jit=jit))
    window = moving(fit(build, x, y, "window", MICRO, not jit, jit=jit))
    assert max_diff(window, large) < 1e-5
    assert max_diff(plain, large) > 1e-2


def test_recompute_and_restore():
    x = (RNG.normal(size=(32, 6)) * 3.0 + 2.0).astype("float32")
    y = RNG.normal(size=(32, 1)).astype("float32")
    alone = fit(dense_model, x, y, "window", MICRO)
    both = fit(
        dense_model,
        x,
        y,
        "window",
        MICRO,
        before=lambda m: apply_recompute(m, in_place=True),
    )
    assert max_diff(moving(both), moving(alone)) < 1e-6
    restore_batchnorm_statistics(both)
    layer = batchnorm_layers(both)[0]
    assert type(layer) is keras.layers.BatchNormalization
    assert layer.momentum == 0.9
    assert len(layer.weights) == 4


def test_keras_file_round_trip_resumes_mid_window(tmp_path):
    x = (RNG.normal(size=(64, 6)) * 3.0 + 2.0).astype("float32")
    y = RNG.normal(size=(64, 1)).astype("float32")
    uninterrupted = fit(dense_model, x, y, "window", MICRO)

    model = dense_model()
    use_window_statistics(model, window=K)
    model.compile(
        GradientAccumulationOptimizer(keras.optimizers.SGD(0.1), K), "mse"
    )
    model.fit(x[:24], y[:24], batch_size=MICRO, shuffle=False, verbose=0)
    path = os.path.join(tmp_path, "window.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    layer = batchnorm_layers(loaded)[0]
    assert type(layer) is window_batch_normalization_class()
    assert np.array(window_state(layer)[0]) == 3
    loaded.fit(x[24:], y[24:], batch_size=MICRO, shuffle=False, verbose=0)
    assert max_diff(moving(loaded), moving(uninterrupted)) < 1e-6


def test_mirrored_two_replicas():
    block = (RNG.normal(size=(4, 6)) * 2.0 + 1.0).astype("float32")
    x = np.concatenate([block] * (2 * K * 2))
    y = np.concatenate([RNG.normal(size=(4, 1)).astype("float32")] * 16)
    large = fit(dense_model, x, y, None, 8 * K, accumulate=False)
    with make_strategy("mirrored_2").scope():
        model = dense_model()
        use_window_statistics(model, window=K)
        model.compile(
            GradientAccumulationOptimizer(keras.optimizers.SGD(0.1), K), "mse"
        )
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    assert np.all(np.isfinite(np.concatenate(moving(model))))
    assert max_diff(moving(model), moving(large)) < 1e-5

"""BatchNormalization remedies on Keras's JAX backend: synchronize_batchnorm
is a no-op under keras.distribution (checked against one device),
freeze_batchnorm after compile, the GroupNormalization conversion."""

from __future__ import annotations

import logging

import keras
import numpy as np
import pytest
from _batchnorm_checks import max_diff, moving

from keras_mgpu.normalization import (
    batchnorm_layers,
    convert_batchnorm_to_groupnorm,
    freeze_batchnorm,
    synchronize_batchnorm,
)
from keras_mgpu.normalization._find import choice_of

RNG = np.random.default_rng(0)
# 32 examples, far from the initial statistics (0 and 1), two updates.
X = (RNG.normal(size=(64, 6)) * 2.0 + 1.0).astype("float32")
Y = RNG.normal(size=(64, 1)).astype("float32")
GLOBAL_BATCH = 32


def mlp() -> keras.Model:
    keras.utils.set_random_seed(7)
    return keras.Sequential(
        [
            keras.Input((6,)),
            keras.layers.Dense(4, use_bias=False, name="hidden"),
            keras.layers.BatchNormalization(momentum=0.5, name="bn"),
            keras.layers.Dense(1, name="head"),
        ]
    )


def train(model) -> keras.Model:
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(X, Y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    return model


@pytest.fixture(scope="module")
def one_device():
    return train(mlp())


def _model_parallel():
    devices = keras.distribution.list_devices("cpu")
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ["batch", "model"], devices=devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*hidden/kernel"] = (None, "model")
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


@pytest.mark.parametrize("kind", ["data_parallel", "model_parallel_2x2"])
def test_synchronize_is_a_no_op_global_statistics_already(
    kind, one_device, caplog
):
    if kind == "data_parallel":
        devices = keras.distribution.list_devices("cpu")
        distribution = keras.distribution.DataParallel(devices=devices)
    else:
        distribution = _model_parallel()
    with distribution.scope():
        model = mlp()
        with caplog.at_level(logging.INFO):
            assert synchronize_batchnorm(model) is model
        train(model)
    assert "nothing to do on the JAX backend" in caplog.text
    layer = batchnorm_layers(model)[0]
    assert layer.synchronized is False
    assert choice_of(layer) == "synchronized"
    if kind == "model_parallel_2x2":  # the layout map applied
        kernel = model.get_layer("hidden").kernel.value
        assert tuple(kernel.sharding.spec) == (None, "model")
    # The moving statistics (and weights) of the global batch: one device's.
    # (Float rounding: the reductions run in another order.)
    for a, b in zip(moving(model), moving(one_device), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(model.weights, one_device.weights, strict=True):
        np.testing.assert_allclose(
            np.array(a), np.array(b), rtol=1e-6, atol=1e-6
        )
    synchronize_batchnorm(model, synchronized=False)
    assert choice_of(layer) is None


@pytest.mark.keras_limit
def test_keras_refuses_synchronized_batchnorm_off_tensorflow():
    # Keras 3.15: `synchronized=True` is TensorFlow-only (on JAX the
    # global step makes it unnecessary). Fails when Keras accepts it.
    with pytest.raises(ValueError, match="only supported with the TensorF"):
        keras.layers.BatchNormalization(synchronized=True)


def test_freeze_after_compile_stops_statistics_and_scale():
    model = mlp()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    layer = batchnorm_layers(model)[0]
    layer.moving_mean.assign(np.linspace(-1, 1, 4).astype("float32"))
    layer.moving_variance.assign(np.linspace(1, 2, 4).astype("float32"))
    before = [np.array(w) for w in layer.weights]
    hidden = np.array(model.get_layer("hidden").kernel)
    freeze_batchnorm(model)
    assert choice_of(layer) == "frozen" and not layer.trainable
    model.fit(X, Y, batch_size=16, shuffle=False, verbose=0)
    assert max_diff([np.array(w) for w in layer.weights], before) == 0.0
    # The rest trains, and the layer normalises with its moving statistics.
    assert max_diff([np.array(model.get_layer("hidden").kernel)], [hidden]) > 0
    gamma, beta, mean, var = before
    h = X[:4] @ np.array(model.get_layer("hidden").kernel)
    expected = (h - mean) / np.sqrt(var + layer.epsilon) * gamma + beta
    head = model.get_layer("head")
    expected = expected @ np.array(head.kernel) + np.array(head.bias)
    np.testing.assert_allclose(
        np.array(model(X[:4], training=True)), expected, atol=1e-5
    )
    # The optimizer was built (by `fit`) without gamma and beta.
    with pytest.warns(UserWarning, match="cannot update 2"):
        freeze_batchnorm(model, frozen=False)
    assert layer.trainable and choice_of(layer) is None


def test_freeze_after_fit_asks_to_compile_again():
    model = mlp()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(X[:16], Y[:16], batch_size=16, verbose=0)
    with pytest.warns(UserWarning, match="Compile the model again"):
        freeze_batchnorm(model)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(X[:16], Y[:16], batch_size=16, verbose=0)


def test_groupnorm_conversion_is_per_example_under_data_parallel():
    devices = keras.distribution.list_devices("cpu")
    distribution = keras.distribution.DataParallel(devices=devices)
    with distribution.scope():
        inputs = keras.Input((4, 4, 8))
        h = keras.layers.BatchNormalization(name="bn")(inputs)
        outputs = keras.layers.Dense(2, name="head")(h)
        model = keras.Model(inputs, outputs)
        layer = model.get_layer("bn")
        layer.gamma.assign(np.linspace(0.5, 1.5, 8).astype("float32"))
        layer.beta.assign(np.linspace(-1, 1, 8).astype("float32"))
        converted = convert_batchnorm_to_groupnorm(model, groups=4)
    new = converted.get_layer("bn")
    assert isinstance(new, keras.layers.GroupNormalization)
    assert new.groups == 4
    np.testing.assert_array_equal(np.array(new.gamma), np.array(layer.gamma))
    x = RNG.normal(size=(8, 4, 4, 8)).astype("float32") * 3.0 + 1.0
    # Closed form: each example normalised over its groups of 2 channels.
    g = x.reshape(8, 4, 4, 4, 2)
    mean = g.mean(axis=(1, 2, 4), keepdims=True)
    var = g.var(axis=(1, 2, 4), keepdims=True)
    normed = ((g - mean) / np.sqrt(var + new.epsilon)).reshape(x.shape)
    expected = normed * np.array(layer.gamma) + np.array(layer.beta)
    head = converted.get_layer("head")
    expected = expected @ np.array(head.kernel) + np.array(head.bias)
    with distribution.scope():
        whole = np.array(converted(x, training=True))
    np.testing.assert_allclose(whole, expected, atol=1e-4)
    # Batch split invariance: one example alone gives the same output.
    np.testing.assert_allclose(
        np.array(converted(x[:1], training=True)), whole[:1], atol=1e-5
    )
    with distribution.scope():
        converted.compile(keras.optimizers.SGD(0.1), "mse")
        converted.fit(x, RNG.normal(size=(8, 4, 4, 2)), batch_size=8, verbose=0)

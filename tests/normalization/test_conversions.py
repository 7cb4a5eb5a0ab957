"""BatchNormalization remedies (Keras 3), written once and run on each
backend: the GroupNormalization conversion (per example under a
data-parallel distribution too), freeze_batchnorm after compile,
accept_micro_batch_statistics and bad input. synchronize_batchnorm: under a
2-replica MirroredStrategy on TensorFlow; a no-op under keras.distribution
on JAX (checked against one device)."""

from __future__ import annotations

import logging
import warnings

import numpy as np
import pytest
from _batchnorm_checks import max_diff, moving

from keras_mgpu import _flavour
from keras_mgpu.normalization import (
    accept_micro_batch_statistics,
    batchnorm_layers,
    convert_batchnorm_to_groupnorm,
    freeze_batchnorm,
    synchronize_batchnorm,
)
from keras_mgpu.normalization._find import choice_of, mark_choice
from keras_mgpu.normalization.conversions import (
    MIN_VALUES_PER_GROUP,
    choose_groups,
)
from keras_mgpu.testing import set_random_seed

pytestmark = pytest.mark.backends("tensorflow", "jax")

keras = _flavour.keras
ON_JAX = keras.backend.backend() == "jax"


def _conv_net(with_nested: bool = True) -> keras.Model:
    """Conv -> BN -> ReLU -> [nested Sequential: Conv -> BN] -> pool ->
    Dense: BN layers at two levels."""
    inputs = keras.Input((6, 6, 3))
    h = keras.layers.Conv2D(16, 3, padding="same", name="conv")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = keras.layers.ReLU(name="relu")(h)
    if with_nested:
        inner = keras.Sequential(
            [
                keras.Input((6, 6, 16)),
                keras.layers.Conv2D(8, 1, name="inner_conv"),
                keras.layers.BatchNormalization(center=False, name="inner_bn"),
            ],
            name="inner",
        )
        h = inner(h)
    h = keras.layers.GlobalAveragePooling2D(name="pool")(h)
    outputs = keras.layers.Dense(2, name="head")(h)
    return keras.Model(inputs, outputs, name="net")


def _data(n: int = 8, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 6, 6, 3)).astype("float32")
    y = rng.normal(size=(n, 2)).astype("float32")
    return x, y


def _randomise_bn(model: keras.Model) -> None:
    """Non-trivial gamma/beta/moving statistics, so copies are checked."""
    rng = np.random.default_rng(7)
    for layer in batchnorm_layers(model):
        for variable in layer.weights:
            shape = tuple(variable.shape)
            variable.assign(rng.uniform(0.5, 1.5, size=shape))


# ----------------------------------------------------------------------
# convert_batchnorm_to_groupnorm
# ----------------------------------------------------------------------
def test_groups_is_the_largest_divisor_leaving_enough_values():
    assert MIN_VALUES_PER_GROUP == 16
    assert choose_groups(64, 32, values_per_channel=36) == 32
    assert choose_groups(48, 32, values_per_channel=36) == 24
    assert choose_groups(16, 32, values_per_channel=36) == 16
    assert choose_groups(7, 4, values_per_channel=9) == 1
    # MobileNetV2 0.35 at 32x32: 56 channels on 2x2 and on 1x1 maps (the
    # paper's rule gave 28 groups of 8 and of 2 values).
    assert choose_groups(56, 32, values_per_channel=4) == 14
    assert choose_groups(56, 32, values_per_channel=1) == 2
    # (batch, C) with fewer than 16 channels: one group of them all.
    assert choose_groups(12, 32, values_per_channel=1) == 1
    assert choose_groups(1, 32, values_per_channel=1) == 0
    # min_values=2: the paper's largest divisor, a group never one value.
    assert choose_groups(56, 32, values_per_channel=1, min_values=2) == 28
    assert choose_groups(12, 32, values_per_channel=1, min_values=2) == 6


# The rebuild itself is backend-independent (clone_model and weight copies);
# JAX compiles each eager op of these direct calls (measured ~10x
# TensorFlow's time for this test and MobileNetV2's), so they run in the
# TensorFlow job; JAX's conversion is checked by
# test_groupnorm_conversion_is_per_example_under_data_parallel and
# test_converted_model_trains_and_round_trips_a_keras_file.
@pytest.mark.backends("tensorflow")
def test_convert_replaces_every_batchnorm_and_copies_the_rest():
    model = _conv_net()
    _randomise_bn(model)
    converted = convert_batchnorm_to_groupnorm(model, groups=4)
    assert batchnorm_layers(converted) == []
    assert batchnorm_layers(model) != []  # the original is untouched
    norms = {
        layer.name: layer
        for layer in converted._flatten_layers()
        if isinstance(layer, keras.layers.GroupNormalization)
    }
    assert {name: n.groups for name, n in norms.items()} == {
        "bn": 4,
        "inner_bn": 4,
    }
    assert norms["inner_bn"].center is False
    # gamma/beta copied; every other layer's weights copied exactly.
    originals = {
        layer.name: layer
        for layer in model._flatten_layers()
        if not isinstance(layer, keras.Model)
    }
    for layer in converted._flatten_layers():
        if isinstance(layer, (keras.Model, keras.layers.InputLayer)):
            continue  # clone_model renames inputs; they hold no weights
        source = originals[layer.name]
        if layer.name in norms:
            np.testing.assert_array_equal(layer.gamma, source.gamma)
            if layer.center:
                np.testing.assert_array_equal(layer.beta, source.beta)
            continue
        for a, b in zip(source.weights, layer.weights, strict=True):
            np.testing.assert_array_equal(a, b)
    # The non-BN parts compute exactly the same; the GroupNormalization
    # computes what a fresh one with these groups and weights computes.
    x, _ = _data()
    conv_of = keras.Model(model.input, model.get_layer("conv").output)
    conv_new = keras.Model(converted.input, converted.get_layer("conv").output)
    np.testing.assert_array_equal(conv_of(x), conv_new(x))
    reference = keras.layers.GroupNormalization(groups=4)
    reference.build((None, 6, 6, 16))
    reference.set_weights(norms["bn"].get_weights())
    bn_new = keras.Model(converted.input, converted.get_layer("bn").output)
    np.testing.assert_allclose(
        bn_new(x), reference(conv_of(x)), rtol=1e-6, atol=1e-6
    )


def test_converted_model_trains_and_round_trips_a_keras_file(tmp_path):
    converted = convert_batchnorm_to_groupnorm(_conv_net())
    converted.compile(keras.optimizers.SGD(0.05), "mse")
    x, y = _data()
    before = [w.copy() for w in converted.get_weights()]
    history = converted.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(before, converted.get_weights(), strict=True)
    )
    path = str(tmp_path / "converted.keras")
    converted.save(path)
    loaded = keras.models.load_model(path)
    assert batchnorm_layers(loaded) == []
    np.testing.assert_allclose(loaded(x), converted(x), rtol=1e-6, atol=1e-6)


def test_sequential_model_and_shared_layers_convert():
    shared = keras.layers.Dense(8, name="shared")
    inputs = keras.Input((8,))
    h = keras.layers.BatchNormalization(name="bn")(shared(inputs))
    outputs = shared(h)
    model = keras.Model(inputs, outputs)
    with pytest.warns(UserWarning, match="fewer than 16 values"):
        converted = convert_batchnorm_to_groupnorm(model, groups=2)
    dense = [
        layer
        for layer in converted.layers
        if isinstance(layer, keras.layers.Dense)
    ]
    assert len(dense) == 1  # still one layer, called twice
    sequential = keras.Sequential(
        [keras.Input((4, 4, 8)), keras.layers.BatchNormalization()]
    )
    converted = convert_batchnorm_to_groupnorm(sequential, groups=32)
    assert isinstance(converted, keras.Sequential)
    assert converted.layers[0].groups == 8


@pytest.mark.backends("tensorflow")  # see above
def test_mobilenet_v2_converts_and_runs():
    model = keras.applications.MobileNetV2(
        alpha=0.35, input_shape=(32, 32, 3), weights=None, classes=10
    )
    count = len(batchnorm_layers(model))
    with warnings.catch_warnings():
        # Its last blocks see 1x1 feature maps: few values per group.
        warnings.simplefilter("ignore", UserWarning)
        converted = convert_batchnorm_to_groupnorm(model)
    norms = [
        layer
        for layer in converted.layers
        if isinstance(layer, keras.layers.GroupNormalization)
    ]
    assert count > 0 and len(norms) == count
    assert batchnorm_layers(converted) == []
    x = np.random.default_rng(0).uniform(size=(2, 32, 32, 3))
    out = np.asarray(converted(x.astype("float32"), training=True))
    assert out.shape == (2, 10) and np.isfinite(out).all()


def test_few_values_per_group_warns_and_one_value_raises():
    inputs = keras.Input((12,))
    outputs = keras.layers.BatchNormalization(name="bn12")(inputs)
    model = keras.Model(inputs, outputs)
    with pytest.warns(UserWarning, match=r"fewer than 16 values.*bn12 \(12\)"):
        converted = convert_batchnorm_to_groupnorm(model)
    assert converted.get_layer("bn12").groups == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        converted = convert_batchnorm_to_groupnorm(
            model, groups=6, min_values_per_group=4
        )
        assert converted.get_layer("bn12").groups == 3  # 4 values each
        converted = convert_batchnorm_to_groupnorm(
            model, min_values_per_group=2
        )
        assert converted.get_layer("bn12").groups == 6  # the paper's rule
    inputs = keras.Input((1,))
    outputs = keras.layers.BatchNormalization(name="bn1")(inputs)
    with pytest.raises(ValueError, match="'bn1' sees one value per example"):
        convert_batchnorm_to_groupnorm(keras.Model(inputs, outputs))


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.bn = keras.layers.BatchNormalization()

    def call(self, x):
        return self.bn(x)


class _Block(keras.layers.Layer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bn = keras.layers.BatchNormalization()

    def call(self, x):
        return self.bn(x)


def test_convert_rejects_what_it_cannot_rebuild():
    model = _Subclassed()
    model(np.zeros((2, 4), "float32"))
    with pytest.raises(ValueError, match="Sequential or functional.*_Subcl"):
        convert_batchnorm_to_groupnorm(model)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, _Block(name="block")(inputs))
    with pytest.raises(ValueError, match="'block' \\(_Block\\) holds"):
        convert_batchnorm_to_groupnorm(model)
    with pytest.raises(ValueError, match="must be built"):
        convert_batchnorm_to_groupnorm(
            keras.Sequential([keras.layers.BatchNormalization()])
        )


@pytest.mark.parametrize(
    "groups, error, match",
    [
        (
            0,
            ValueError,
            r"`groups` must be an integer >= 1. Received: groups=0",
        ),
        ("a", TypeError, r"`groups` must be .*groups='a' \(of type str\)"),
        (2.0, TypeError, r"groups=2.0"),
    ],
)
def test_bad_groups(groups, error, match):
    with pytest.raises(error, match=match):
        convert_batchnorm_to_groupnorm(_conv_net(False), groups=groups)


@pytest.mark.parametrize(
    "value, error, match",
    [
        (1, ValueError, r"`min_values_per_group` must be an integer >= 2"),
        (None, TypeError, r"min_values_per_group=None"),
    ],
)
def test_bad_min_values_per_group(value, error, match):
    with pytest.raises(error, match=match):
        convert_batchnorm_to_groupnorm(
            _conv_net(False), min_values_per_group=value
        )


@pytest.mark.parametrize(
    "function",
    [
        synchronize_batchnorm,
        freeze_batchnorm,
        accept_micro_batch_statistics,
        convert_batchnorm_to_groupnorm,
    ],
)
def test_non_models_are_type_errors_and_models_without_bn_warn(function):
    with pytest.raises(TypeError, match=r"`model` must be a Keras model.*'x'"):
        function("x")
    plain = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    with pytest.warns(UserWarning, match="no BatchNormalization layers"):
        result = function(plain)
    if function is convert_batchnorm_to_groupnorm:
        assert result is not plain
        np.testing.assert_array_equal(
            result.layers[0].kernel, plain.layers[0].kernel
        )
    else:
        assert result is plain


@pytest.mark.parametrize(
    "function, argument",
    [
        (synchronize_batchnorm, "synchronized"),
        (freeze_batchnorm, "frozen"),
        (accept_micro_batch_statistics, "accepted"),
    ],
)
def test_switch_must_be_a_bool(function, argument):
    with pytest.raises(TypeError, match=f"`{argument}` must be True or False"):
        function(_conv_net(False), **{argument: 1})


# ----------------------------------------------------------------------
# synchronize_batchnorm
# ----------------------------------------------------------------------
def _bn_model(strategy) -> tuple:
    """A model of one momentum-0 BatchNormalization (its moving mean is
    the last batch mean), built under `strategy`."""
    with strategy.scope():
        inputs = keras.Input((3,))
        bn = keras.layers.BatchNormalization(momentum=0.0)
        model = keras.Model(inputs, bn(inputs))
    return model, bn


def _step(strategy, model, bn, shards) -> list:
    """One training call, replica r fed shards[r]: each replica's moving
    mean afterwards."""
    import tensorflow as tf

    values = strategy.experimental_distribute_values_from_function(
        lambda context: tf.constant(shards[context.replica_id_in_sync_group])
    )

    @tf.function
    def step(x):
        strategy.run(lambda v: model(v, training=True), args=(x,))

    step(values)
    return [
        np.asarray(v)
        for v in strategy.experimental_local_results(bn.moving_mean.value)
    ]


@pytest.mark.backends("tensorflow")
def test_synchronized_statistics_are_the_global_batch_and_reversible(
    mirrored_strategy, tmp_path
):
    strategy = mirrored_strategy(2)
    rng = np.random.default_rng(3)
    shards = [
        rng.normal(0.0, 1.0, size=(4, 3)).astype("float32"),
        rng.normal(10.0, 1.0, size=(4, 3)).astype("float32"),
    ]
    global_mean = np.concatenate(shards).mean(axis=0)
    model, bn = _bn_model(strategy)
    local = _step(strategy, model, bn, shards)
    np.testing.assert_allclose(local[0], shards[0].mean(axis=0), rtol=1e-5)
    np.testing.assert_allclose(local[1], shards[1].mean(axis=0), rtol=1e-5)
    assert synchronize_batchnorm(model) is model
    assert bn.synchronized and choice_of(bn) == "synchronized"
    synced = _step(strategy, model, bn, shards)
    for replica in synced:
        np.testing.assert_allclose(replica, global_mean, rtol=1e-5)
    # In the config, hence in .keras files.
    path = str(tmp_path / "synced.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [layer.synchronized for layer in batchnorm_layers(loaded)] == [True]
    synchronize_batchnorm(model, synchronized=False)
    assert not bn.synchronized and choice_of(bn) is None
    again = _step(strategy, model, bn, shards)
    np.testing.assert_allclose(again[1], shards[1].mean(axis=0), rtol=1e-5)


@pytest.mark.backends("tensorflow")
def test_synchronize_reaches_a_compiled_model_and_keeps_a_micro_choice():
    model = _conv_net()
    model.compile("sgd", "mse")
    x, y = _data()
    model.fit(x, y, batch_size=4, verbose=0)
    assert model.train_function is not None
    inner_bn = model.get_layer("inner").get_layer("inner_bn")
    mark_choice(inner_bn, "window")
    synchronize_batchnorm(model)
    assert model.train_function is None  # traced anew at the next fit
    assert all(layer.synchronized for layer in batchnorm_layers(model))
    assert choice_of(model.get_layer("bn")) == "synchronized"
    assert choice_of(inner_bn) == "window"
    model.fit(x, y, batch_size=4, verbose=0)
    synchronize_batchnorm(model, synchronized=False)
    assert choice_of(inner_bn) == "window"
    assert choice_of(model.get_layer("bn")) is None


# ----------------------------------------------------------------------
# freeze_batchnorm
# ----------------------------------------------------------------------
@pytest.mark.backends("tensorflow")
def test_freeze_after_fit_takes_effect_without_compile_and_is_reversible():
    model = _conv_net()
    model.get_layer("inner").get_layer("inner_bn").trainable = False
    model.compile(keras.optimizers.SGD(0.1), "mse")
    x, y = _data()
    model.fit(x, y, batch_size=4, verbose=0)
    bn = model.get_layer("bn")
    frozen_state = [np.asarray(w).copy() for w in bn.weights]
    with warnings.catch_warnings():
        # Keras's "trainable state has changed since compile" must not come.
        warnings.simplefilter("error")
        freeze_batchnorm(model)
        model.fit(x, y, batch_size=4, epochs=2, verbose=0)
    assert choice_of(bn) == "frozen"
    for before, after in zip(frozen_state, bn.weights, strict=True):
        np.testing.assert_array_equal(before, after)
    # Inference mode in training: outputs with training=True use the
    # moving statistics.
    np.testing.assert_allclose(
        model(x, training=True), model(x, training=False), rtol=1e-6
    )
    freeze_batchnorm(model, frozen=False)
    assert bn.trainable and choice_of(bn) is None
    # The layer frozen by the user before stays frozen.
    assert not model.get_layer("inner").get_layer("inner_bn").trainable
    model.fit(x, y, batch_size=4, verbose=0)
    assert not np.array_equal(frozen_state[0], bn.weights[0])


def test_accept_marks_and_unmarks():
    model = _conv_net()
    accept_micro_batch_statistics(model)
    assert {choice_of(layer) for layer in batchnorm_layers(model)} == {
        "accepted"
    }
    accept_micro_batch_statistics(model, accepted=False)
    assert {choice_of(layer) for layer in batchnorm_layers(model)} == {None}


# ----------------------------------------------------------------------
# A Dense -> BN -> Dense model against one device's large batch
# ----------------------------------------------------------------------
RNG = np.random.default_rng(0)
# 32 examples, far from the initial statistics (0 and 1), two updates.
X = (RNG.normal(size=(64, 6)) * 2.0 + 1.0).astype("float32")
Y = RNG.normal(size=(64, 1)).astype("float32")
GLOBAL_BATCH = 32


def mlp() -> keras.Model:
    set_random_seed(7)
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


@pytest.mark.backends("jax")
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


@pytest.mark.backends("jax")
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
    with pytest.warns(UserWarning, match="cannot update 2.*Compile the model"):
        freeze_batchnorm(model, frozen=False)
    assert layer.trainable and choice_of(layer) is None
    # Compiled again, with a new optimizer, the layer trains.
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(X, Y, batch_size=16, shuffle=False, verbose=0)
    assert max_diff([np.array(layer.gamma)], [gamma]) > 0


@pytest.mark.backends("jax")
def test_freeze_after_fit_asks_to_compile_again():
    # Keras's JAX trainer needs the optimizer built with exactly the
    # trainable variables (on TensorFlow the freeze takes effect as it is:
    # test_freeze_after_fit_takes_effect_without_compile_and_is_reversible).
    model = mlp()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(X[:16], Y[:16], batch_size=16, verbose=0)
    with pytest.warns(UserWarning, match="Compile the model again"):
        freeze_batchnorm(model)
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(X[:16], Y[:16], batch_size=16, verbose=0)


def test_groupnorm_conversion_is_per_example_under_data_parallel():
    from conftest import make_strategy

    # DataParallel over the 4 CPU devices on JAX, Mirrored over 2 replicas
    # on TensorFlow.
    strategy = make_strategy("data_parallel_4" if ON_JAX else "mirrored_2")
    with strategy.scope():
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
    with strategy.scope():
        whole = np.array(converted(x, training=True))
    np.testing.assert_allclose(whole, expected, atol=1e-4)
    # Batch split invariance: one example alone gives the same output.
    np.testing.assert_allclose(
        np.array(converted(x[:1], training=True)), whole[:1], atol=1e-5
    )
    with strategy.scope():
        converted.compile(keras.optimizers.SGD(0.1), "mse")
        converted.fit(x, RNG.normal(size=(8, 4, 4, 2)), batch_size=8, verbose=0)

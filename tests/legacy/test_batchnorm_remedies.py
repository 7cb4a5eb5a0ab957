"""tf_keras: the BatchNormalization remedies and BatchNormMicroBatchWarning
(the Keras 3 tests are tests/normalization/): cross-replica statistics
under a 2-replica MirroredStrategy, kept by `.keras` files; freezing after
compile (tf_keras's `fit` would restore the compiled flags); the
GroupNormalization conversion; synchronisation composed with window
statistics (every order, `.keras` files, an uneven split across replicas);
the warning, also through mixed precision's LossScaleOptimizer under
Mirrored and in custom training loops, at the user's line."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from _batchnorm_checks import (
    COMPOSITION_ORDERS,
    check_composition,
    check_synchronized_window_file,
    check_synchronized_window_uneven_split,
)

from keras_mgpu._flavour import keras, tf
from keras_mgpu.normalization import (
    BatchNormMicroBatchWarning,
    accept_micro_batch_statistics,
    batchnorm_layers,
    convert_batchnorm_to_groupnorm,
    freeze_batchnorm,
    synchronize_batchnorm,
)
from keras_mgpu.normalization._find import choice_of
from keras_mgpu.optimizers import GradientAccumulationOptimizer

RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 4, 4, 3)).astype("float32")
Y = RNG.normal(size=(16, 1)).astype("float32")


def _net() -> keras.Model:
    inner = keras.Sequential(
        [
            keras.layers.Conv2D(8, 1, input_shape=(4, 4, 8)),
            keras.layers.BatchNormalization(name="inner_bn"),
        ],
        name="inner",
    )
    inputs = keras.Input((4, 4, 3))
    h = keras.layers.Conv2D(8, 3, padding="same", name="conv")(inputs)
    h = keras.layers.BatchNormalization(name="bn")(h)
    h = inner(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(h))


def test_synchronized_statistics_are_the_global_batch(
    mirrored_strategy, tmp_path
):
    strategy = mirrored_strategy(2)
    shards = [
        RNG.normal(0.0, 1.0, size=(4, 3)).astype("float32"),
        RNG.normal(10.0, 1.0, size=(4, 3)).astype("float32"),
    ]
    with strategy.scope():
        inputs = keras.Input((3,))
        bn = keras.layers.BatchNormalization(momentum=0.0)
        model = keras.Model(inputs, bn(inputs))

    def step() -> list:
        values = strategy.experimental_distribute_values_from_function(
            lambda c: tf.constant(shards[c.replica_id_in_sync_group])
        )
        tf.function(
            lambda x: strategy.run(lambda v: model(v, training=True), (x,))
        )(values)
        return [
            np.asarray(v)
            for v in strategy.experimental_local_results(bn.moving_mean)
        ]

    local = step()
    np.testing.assert_allclose(local[1], shards[1].mean(0), rtol=1e-5)
    synchronize_batchnorm(model)
    assert choice_of(bn) == "synchronized"
    for replica in step():
        np.testing.assert_allclose(
            replica, np.concatenate(shards).mean(0), rtol=1e-5
        )
    # tf_keras's BatchNormalization.get_config drops `synchronized`: the
    # layer is saved as SyncBatchNormalization and loads synchronized.
    path = str(tmp_path / "synced.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert [layer.synchronized for layer in batchnorm_layers(loaded)] == [True]
    synchronize_batchnorm(model, synchronized=False)
    assert type(bn) is keras.layers.BatchNormalization
    assert not bn.synchronized and choice_of(bn) is None
    np.testing.assert_allclose(step()[1], shards[1].mean(0), rtol=1e-5)


def test_freeze_after_compile_takes_effect_and_is_reversible():
    model = _net()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(X, Y, batch_size=8, verbose=0)
    bn = model.get_layer("bn")
    before = [np.asarray(w).copy() for w in bn.weights]
    freeze_batchnorm(model)
    model.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    for old, new in zip(before, bn.weights, strict=True):
        np.testing.assert_array_equal(old, new)
    freeze_batchnorm(model, frozen=False)
    assert bn.trainable and choice_of(bn) is None
    model.fit(X, Y, batch_size=8, verbose=0)
    assert not np.array_equal(before[0], bn.weights[0])


def test_unfreeze_warns_when_the_optimizer_was_built_frozen():
    model = _net()
    model.compile(keras.optimizers.SGD(0.1), "mse")
    freeze_batchnorm(model)
    model.fit(X, Y, batch_size=8, verbose=0)
    with pytest.warns(UserWarning, match="Compile the model again"):
        freeze_batchnorm(model, frozen=False)


def test_convert_to_groupnorm_trains_and_round_trips(tmp_path):
    model = _net()
    converted = convert_batchnorm_to_groupnorm(model, groups=4)
    assert batchnorm_layers(converted) == []
    norms = [
        layer
        for layer in converted._flatten_layers()
        if isinstance(layer, keras.layers.GroupNormalization)
    ]
    assert sorted((n.name, n.groups) for n in norms) == [
        ("bn", 4),
        ("inner_bn", 4),
    ]
    np.testing.assert_array_equal(
        converted.get_layer("conv").kernel, model.get_layer("conv").kernel
    )
    converted.compile(keras.optimizers.SGD(0.05), "mse")
    history = converted.fit(X, Y, batch_size=8, epochs=2, verbose=0)
    assert np.isfinite(history.history["loss"]).all()
    path = str(tmp_path / "converted.keras")
    converted.save(path)
    loaded = keras.models.load_model(path)
    np.testing.assert_allclose(loaded(X), converted(X), rtol=1e-6, atol=1e-6)


def _dense_net() -> keras.Model:
    return keras.Sequential(
        [
            keras.layers.Dense(4, input_shape=(3,)),
            keras.layers.BatchNormalization(),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(1),
        ]
    )


def _fit_warnings(model, strategy, compiles: int) -> list:
    x, y = X[:, 0, 0, :], Y
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(compiles):  # a new optimizer each time: still once
            with strategy.scope():
                model.compile(
                    GradientAccumulationOptimizer(
                        keras.optimizers.SGD(0.01), accumulation_steps=2
                    ),
                    "mse",
                )
            model.fit(x, y, batch_size=8, verbose=0)
    found = [
        w for w in caught if issubclass(w.category, BatchNormMicroBatchWarning)
    ]
    # The user's line (the `fit` call), not AutoGraph's generated file.
    assert all(w.filename == __file__ for w in found)
    return found


def test_warns_once_through_loss_scaling_under_mirrored(mirrored_strategy):
    # Its LossScaleOptimizer calls ours from threads of its own
    # (merge_call, then call_for_each_replica): found on another thread.
    strategy = mirrored_strategy(2)
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        with strategy.scope():
            model = _dense_net()
        found = _fit_warnings(model, strategy, compiles=1)
    finally:
        keras.mixed_precision.set_global_policy("float32")
    assert len(found) == 1
    assert "has 2 trainable BatchNormalization layers" in str(found[0].message)
    chosen = accept_micro_batch_statistics(_dense_net())
    assert _fit_warnings(chosen, tf.distribute.get_strategy(), 1) == []


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_custom_loop_warns_once_at_the_users_line(graph):
    model = _dense_net()
    optimizer = GradientAccumulationOptimizer(
        keras.optimizers.SGD(0.01), accumulation_steps=2
    )
    x, y = X[:, 0, 0, :], Y

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        variables = model.trainable_variables
        optimizer.apply_gradients(
            zip(tape.gradient(loss, variables), variables)
        )

    if graph:
        step = tf.function(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            step()
    found = [
        w for w in caught if issubclass(w.category, BatchNormMicroBatchWarning)
    ]
    assert len(found) == 1
    assert "has 2 trainable BatchNormalization layers" in str(found[0].message)
    assert found[0].filename == __file__


@pytest.mark.parametrize("order", COMPOSITION_ORDERS)
def test_synchronize_and_window_compose_and_undo_in_any_order(order):
    # tf_keras swaps classes for both (SyncBatchNormalization,
    # WindowBatchNormalization): each keeps the other's.
    check_composition(keras, order)


@pytest.mark.parametrize("order", ["sync,window", "window,sync"])
def test_synchronized_window_keras_file_resumes_mid_window(order, tmp_path):
    # Saved as WindowSyncBatchNormalization, registered under keras_mgpu.
    check_synchronized_window_file(
        keras, order, str(tmp_path / "synchronized_window.keras")
    )


def test_synchronized_window_with_uneven_replica_split_is_the_large_batch(
    mirrored_strategy,
):
    check_synchronized_window_uneven_split(
        keras, mirrored_strategy(2), "sync,window"
    )


@pytest.mark.slow  # a fresh Python process importing TensorFlow
def test_synchronized_window_file_loads_in_a_fresh_process(tmp_path):
    # WindowSyncBatchNormalization is registered when keras_mgpu is
    # imported, not only once a layer was switched in this process.
    import subprocess
    import sys

    from keras_mgpu.normalization import use_window_statistics

    inputs = keras.Input((3,))
    model = keras.Model(inputs, keras.layers.BatchNormalization()(inputs))
    use_window_statistics(synchronize_batchnorm(model), window=2)
    path = str(tmp_path / "synchronized_window.keras")
    model.save(path)
    code = (
        "import sys, keras_mgpu.normalization, tf_keras; "
        "layer = tf_keras.models.load_model(sys.argv[1]).layers[-1]; "
        "print(type(layer).__name__, layer.synchronized, layer.window)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, path],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[-3:] == [
        "WindowSyncBatchNormalization",
        "True",
        "2",
    ]

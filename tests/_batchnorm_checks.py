"""Shared checks of BatchNormalization moving statistics (both Keras
flavours' window-statistics tests)."""

from __future__ import annotations

import numpy as np

from keras_mgpu.normalization import batchnorm_layers


def moving(model) -> list:
    """Every BatchNormalization layer's moving mean and variance, as arrays."""
    return [
        np.array(v)
        for layer in batchnorm_layers(model)
        for v in (layer.moving_mean, layer.moving_variance)
    ]


def max_diff(a: list, b: list) -> float:
    return max(float(np.abs(u - v).max()) for u, v in zip(a, b, strict=True))


# `synchronize_batchnorm` and `use_window_statistics` applied and undone in
# every order (steps: "sync", "window", "unsync", "restore").
COMPOSITION_ORDERS = [
    "sync,window,unsync,restore",
    "sync,window,restore,unsync",
    "window,sync,unsync,restore",
    "window,sync,restore,unsync",
]

# 4-D: tf_keras picks its fused kernel, which synchronising turns off.
COMPOSITION_X = (
    np.random.default_rng(3).normal(size=(4, 2, 2, 3)) * 2.0 + 1.0
).astype("float32")


def composition_model(keras):
    keras.utils.set_random_seed(5)
    inputs = keras.Input((2, 2, 3))
    layer = keras.layers.BatchNormalization(momentum=0.9, name="bn")
    return keras.Model(inputs, layer(inputs)), layer


def check_composition(keras, order: str) -> None:
    """Apply and undo synchronisation and window statistics in `order`;
    after each step the layer is what the remedies in force make it (class,
    `synchronized`, weights, config, choice, a config round trip, a
    training call), and after the last it is the plain layer again."""
    from keras_mgpu.normalization import (
        restore_batchnorm_statistics,
        synchronize_batchnorm,
        use_window_statistics,
    )
    from keras_mgpu.normalization._find import choice_of
    from keras_mgpu.normalization.window_statistics import window_state

    model, layer = composition_model(keras)
    model(COMPOSITION_X, training=True)  # Keras's own lazy attributes
    plain = {
        "class": type(layer),
        "dict": set(layer.__dict__),
        "config": layer.get_config(),
        "weights": [w.name for w in layer.weights],
        "fused": getattr(layer, "fused", None),
    }
    steps = {
        "sync": lambda: synchronize_batchnorm(model),
        "window": lambda: use_window_statistics(model, window=2),
        "unsync": lambda: synchronize_batchnorm(model, synchronized=False),
        "restore": lambda: restore_batchnorm_statistics(model),
    }
    active: set = set()
    for step in order.split(","):
        steps[step]()
        {"sync": active.add, "window": active.add}.get(step, active.discard)(
            {"unsync": "sync", "restore": "window"}.get(step, step)
        )
        synced, windowed = "sync" in active, "window" in active
        where = f"after {step!r} in {order!r}"
        assert bool(layer.synchronized) is synced, where
        assert (type(layer).__name__.startswith("Window")) is windowed, where
        assert len(window_state(layer)) == 4 * windowed, where
        assert len(layer.weights) == 4 + 4 * windowed, where
        config = layer.get_config()
        assert config["momentum"] == 0.9, where
        assert config.get("window") == (2 if windowed else None), where
        assert choice_of(layer) == (
            "window" if windowed else "synchronized" if synced else None
        ), where
        copy = keras.layers.deserialize(keras.layers.serialize(layer))
        assert type(copy) is type(layer), where
        assert bool(copy.synchronized) is synced, where
        model(COMPOSITION_X, training=True)
    assert type(layer) is plain["class"]
    assert set(layer.__dict__) == plain["dict"]
    assert layer.get_config() == plain["config"]
    assert [w.name for w in layer.weights] == plain["weights"]
    assert getattr(layer, "fused", None) == plain["fused"]
    # It trains as a plain layer from the same state does.
    fresh, fresh_layer = composition_model(keras)
    fresh.set_weights(model.get_weights())
    for each in (model, fresh):
        each(COMPOSITION_X, training=True)
    np.testing.assert_array_equal(
        np.array(layer.moving_variance), np.array(fresh_layer.moving_variance)
    )


def check_synchronized_window_file(keras, order: str, path: str) -> None:
    """Synchronised + window statistics (applied in `order`: "sync,window"
    or "window,sync") saved mid-window to a `.keras` file loads back
    synchronised, switched, with the window in progress, and completes the
    window as the original does."""
    from keras_mgpu.normalization import (
        batchnorm_layers,
        synchronize_batchnorm,
        use_window_statistics,
    )
    from keras_mgpu.normalization.window_statistics import window_state

    model, layer = composition_model(keras)
    for step in order.split(","):
        if step == "sync":
            synchronize_batchnorm(model)
        else:
            use_window_statistics(model, window=2)
    model(COMPOSITION_X, training=True)  # mid-window
    model.save(path)
    loaded = keras.models.load_model(path)
    (copy,) = batchnorm_layers(loaded)
    assert type(copy) is type(layer)
    assert copy.synchronized and copy.window == 2
    assert float(np.array(window_state(copy)[0])) == 1.0
    for a, b in zip(layer.weights, copy.weights, strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    for each in (model, loaded):
        each(COMPOSITION_X[::-1] * 3.0, training=True)  # completes it
    assert float(np.array(window_state(copy)[0])) == 0.0
    assert max_diff(moving(loaded), moving(model)) == 0.0


def replica_values(variable) -> list:
    """Each replica's copy of a variable made under a `tf.distribute`
    strategy (Keras 3 wraps the distributed variable in `.value`)."""
    distributed = variable
    if not hasattr(distributed, "values"):  # Keras 3
        distributed = variable.value
    return [np.array(v) for v in distributed.values]


def check_synchronized_window_uneven_split(keras, strategy, order) -> None:
    """Synchronised + window statistics under a 2-replica `strategy`, with
    batches that do not split evenly (29 examples in micro-batches of 8:
    the last one 5, 3 + 2 per replica), window 4: every replica's moving
    statistics are the large batch's (29 examples in one step on one
    device). BatchNormalization comes first, so what each micro-batch
    brings it is the data whatever the optimizer does: plain SGD (the
    window counts calls, not updates) keeps the test fast."""
    from keras_mgpu.normalization import (
        synchronize_batchnorm,
        use_window_statistics,
    )

    rng = np.random.default_rng(4)
    x = (rng.normal(size=(29, 6)) * 3.0 + 2.0).astype("float32")
    y = rng.normal(size=(29, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(7)
        inputs = keras.Input((6,))
        layer = keras.layers.BatchNormalization(momentum=0.9)
        return keras.Model(inputs, keras.layers.Dense(1)(layer(inputs))), layer

    large, large_layer = build()
    large.compile(keras.optimizers.SGD(0.1), "mse")
    large.fit(x, y, batch_size=32, shuffle=False, verbose=0)
    expected = [
        np.array(large_layer.moving_mean),
        np.array(large_layer.moving_variance),
    ]
    with strategy.scope():
        model, layer = build()
        for step in order.split(","):
            if step == "sync":
                synchronize_batchnorm(model)
            else:
                use_window_statistics(model, window=4)
        model.compile(keras.optimizers.SGD(0.1), "mse")
    model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
    for replica in range(2):
        found = [
            replica_values(layer.moving_mean)[replica],
            replica_values(layer.moving_variance)[replica],
        ]
        assert max_diff(found, expected) < 1e-5, (replica, found, expected)

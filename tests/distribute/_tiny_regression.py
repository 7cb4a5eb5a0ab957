"""The small regression problem the multi-worker test bodies train (backup,
fault matrix, cluster shapes): 5 features, a linear target, a Dense 8-tanh
+ Dense 1 model. Each body picks its own sizes and seeds."""

from __future__ import annotations

from typing import Any


def data(samples: int, seed: int) -> tuple:
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    return x, y


def compiled_model(seed: int, optimizer: Any) -> Any:
    """The model, built after seeding, compiled with `optimizer` (a
    callable taking the Keras module, so it is built after the seed)."""
    from keras_mgpu._flavour import keras
    from keras_mgpu.testing import set_random_seed

    set_random_seed(seed)  # on JAX without importing TensorFlow
    model = keras.Sequential(
        [
            keras.Input((5,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=optimizer(keras), loss="mse")
    return model

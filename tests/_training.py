"""Small models, data and training runs shared by the tests.

Every equivalence test compares a run against the plain computation: the
same model, initial weights and samples in the same order, on one device.
"""

from __future__ import annotations

import numpy as np

from keras_mgpu._flavour import keras


def regression_data(samples: int, features: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, features)).astype("float32")
    w = rng.normal(size=(features, 1)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(samples, 1))).astype("float32")
    return x, y


def mlp(features: int = 6, hidden: int = 16, seed: int = 7) -> keras.Model:
    """A small MLP whose initial weights depend only on `seed`."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [
            keras.Input((features,)),
            keras.layers.Dense(hidden, activation="tanh"),
            keras.layers.Dense(hidden, activation="relu"),
            keras.layers.Dense(1),
        ]
    )


def max_abs_diff(weights_a, weights_b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
        for a, b in zip(weights_a, weights_b)
    )


def assert_weights_close(actual, expected, rtol=1e-4, atol=1e-5) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol)

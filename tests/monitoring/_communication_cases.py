"""Shared by the TensorFlow and JAX tests of
`keras_mgpu.monitoring.communication`: one small model and the plain count
of its gradients' bytes, computed here without the package."""

from __future__ import annotations

import numpy as np

# Dense 8 -> 16 -> 3: kernels (8, 16) and (16, 3), biases (16,) and (3,).
LAYER_SHAPES = [(8, 16), (16,), (16, 3), (3,)]
BATCH = 16


def build_model(keras, optimizer="sgd", metrics=None):
    """The model, compiled, named so that a LayoutMap can find it."""
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, name="d1"),
            keras.layers.Dense(3, name="d2"),
        ]
    )
    model.compile(optimizer=optimizer, loss="mse", metrics=metrics)
    return model


def batch(rows=BATCH):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, 8)).astype("float32")
    y = rng.standard_normal((rows, 3)).astype("float32")
    return x, y


def float32_bytes(shapes=LAYER_SHAPES):
    """The gradients' bytes in float32: the plain computation."""
    return sum(4 * int(np.prod(shape)) for shape in shapes)

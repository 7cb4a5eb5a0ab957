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

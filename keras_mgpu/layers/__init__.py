"""Layers: recompute activations in the backward pass (gradient
checkpointing), by wrapping a block or by switching chosen layers of a model
in place."""

from keras_mgpu.layers.apply_recompute import (
    apply_recompute,
    recomputed_layers,
    strip_recompute,
)
from keras_mgpu.layers.recompute_grad import RecomputeGrad

__all__ = [
    "RecomputeGrad",
    "apply_recompute",
    "recomputed_layers",
    "strip_recompute",
]

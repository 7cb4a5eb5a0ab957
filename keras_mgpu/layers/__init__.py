"""Layers: the recompute-gradient wrapper and its model-level helpers."""

from keras_mgpu.layers.apply_recompute import apply_recompute, strip_recompute
from keras_mgpu.layers.recompute_grad import RecomputeGrad

__all__ = ["RecomputeGrad", "apply_recompute", "strip_recompute"]

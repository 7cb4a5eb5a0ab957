"""Model parallelism on JAX for any Keras model: a
`keras.distribution.LayoutMap` planned from the model (`plan_layout_map`),
and a checker and report for any layout map (`check_layout_map`,
`LayoutReport`). JAX only; on TensorFlow `keras_mgpu.apply_placement` splits
a model across devices layer by layer."""

from keras_mgpu.sharding.check import LayoutReport, check_layout_map
from keras_mgpu.sharding.plan import plan_layout_map

__all__ = ["LayoutReport", "check_layout_map", "plan_layout_map"]

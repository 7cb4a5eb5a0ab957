"""Optimizer wrappers: gradient accumulation under any strategy."""

from keras_mgpu._flavour import IS_TF_KERAS

if IS_TF_KERAS:
    from keras_mgpu.optimizers.gradient_accumulation_tf_keras import (
        GradientAccumulationOptimizer,
    )
else:
    from keras_mgpu.optimizers.gradient_accumulation import (
        GradientAccumulationOptimizer,
    )

__all__ = ["GradientAccumulationOptimizer"]

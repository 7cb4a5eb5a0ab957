"""keras_mgpu: drop-in Keras components for training on many devices.

Gradient accumulation that is exact under `tf.distribute`, learning-rate
scaling and warmup counted in optimizer updates, memory and GPU-load monitors
that log next to the loss, and a recompute-gradient layer wrapper. Built on
Keras 3 (TensorFlow backend), or on tf_keras when `TF_USE_LEGACY_KERAS=1`.
"""

from keras_mgpu import callbacks, distribute, layers, optimizers, schedules
from keras_mgpu._flavour import FLAVOUR
from keras_mgpu.distribute import global_batch_size, num_replicas_in_sync
from keras_mgpu.layers import RecomputeGrad, apply_recompute, strip_recompute
from keras_mgpu.optimizers import GradientAccumulationOptimizer
from keras_mgpu.schedules import Warmup, scaled_learning_rate

__version__ = "0.1.0"

__all__ = [
    "FLAVOUR",
    "GradientAccumulationOptimizer",
    "RecomputeGrad",
    "Warmup",
    "__version__",
    "apply_recompute",
    "callbacks",
    "distribute",
    "global_batch_size",
    "layers",
    "num_replicas_in_sync",
    "optimizers",
    "scaled_learning_rate",
    "schedules",
    "strip_recompute",
]

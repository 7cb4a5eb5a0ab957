"""keras_mgpu: drop-in Keras components for training on many devices."""

from keras_mgpu._flavour import FLAVOUR
from keras_mgpu.distribute import global_batch_size
from keras_mgpu.distribute import num_replicas_in_sync
from keras_mgpu.optimizers import GradientAccumulationOptimizer

__version__ = "0.1.0"

__all__ = [
    "FLAVOUR",
    "GradientAccumulationOptimizer",
    "__version__",
    "global_batch_size",
    "num_replicas_in_sync",
]

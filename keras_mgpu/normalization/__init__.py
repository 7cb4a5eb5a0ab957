"""BatchNormalization when batches are split: micro-batches of gradient
accumulation, pipeline micro-batches and replicas.

See docs/guides/batchnorm.md for which remedy to use when.
"""

from keras_mgpu.normalization._find import batchnorm_layers
from keras_mgpu.normalization.window_statistics import (
    restore_batchnorm_statistics,
    use_window_statistics,
)

__all__ = [
    "batchnorm_layers",
    "restore_batchnorm_statistics",
    "use_window_statistics",
]

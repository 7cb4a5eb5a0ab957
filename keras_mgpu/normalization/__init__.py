"""BatchNormalization when batches are split: micro-batches of gradient
accumulation, pipeline micro-batches and replicas.

See docs/guides/batchnorm.md for which remedy to use when.
"""

from keras_mgpu.normalization._find import batchnorm_layers
from keras_mgpu.normalization._warn import BatchNormMicroBatchWarning
from keras_mgpu.normalization.conversions import (
    accept_micro_batch_statistics,
    convert_batchnorm_to_groupnorm,
    freeze_batchnorm,
    synchronize_batchnorm,
)
from keras_mgpu.normalization.window_statistics import (
    restore_batchnorm_statistics,
    use_window_statistics,
)

__all__ = [
    "BatchNormMicroBatchWarning",
    "accept_micro_batch_statistics",
    "batchnorm_layers",
    "convert_batchnorm_to_groupnorm",
    "freeze_batchnorm",
    "restore_batchnorm_statistics",
    "synchronize_batchnorm",
    "use_window_statistics",
]

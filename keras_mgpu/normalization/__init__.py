"""BatchNormalization when batches are split: micro-batches of gradient
accumulation, pipeline micro-batches and replicas.

Remedies, each one call on a whole model (see docs/guides/batchnorm.md for
which to use when):

- `use_window_statistics`: moving statistics advance once per optimizer
  update, as the large batch would move them (`restore_batchnorm_statistics`
  undoes it);
- `synchronize_batchnorm`: cross-replica statistics under `tf.distribute`;
- `freeze_batchnorm`: inference-mode BatchNormalization (fine-tuning);
- `convert_batchnorm_to_groupnorm`: a new model with GroupNormalization;
- `accept_micro_batch_statistics`: keep Keras's behaviour, knowingly.

`GradientAccumulationOptimizer` and `apply_placement` warn once
(`BatchNormMicroBatchWarning`) when a model with BatchNormalization is split
into micro-batches with none of these chosen.
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

"""Strategy helpers and multi-worker training support.

- `keras_mgpu.distribute.strategy`: replicas in sync, global batch size,
  worker identity (re-exported here).
- `keras_mgpu.distribute.multi_worker_fit`: `enable_multi_worker_fit()`, the
  explicit fix that makes Keras 3 `model.fit` work under
  `MultiWorkerMirroredStrategy` (keras-team/keras#20585).
"""

from __future__ import annotations

from keras_mgpu.distribute.multi_worker_fit import (
    MultiWorkerFitWarning,
    disable_multi_worker_fit,
    enable_multi_worker_fit,
    multi_worker_fit_enabled,
)
from keras_mgpu.distribute.strategy import (
    accumulation_steps_of,
    current_strategy,
    global_batch_size,
    is_multi_worker,
    num_replicas_in_sync,
    strategy_kind,
    worker_info,
)

__all__ = [
    "MultiWorkerFitWarning",
    "accumulation_steps_of",
    "current_strategy",
    "disable_multi_worker_fit",
    "enable_multi_worker_fit",
    "global_batch_size",
    "is_multi_worker",
    "multi_worker_fit_enabled",
    "num_replicas_in_sync",
    "strategy_kind",
    "worker_info",
]

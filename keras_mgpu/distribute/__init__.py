"""Strategy helpers and multi-worker training support.

- `keras_mgpu.distribute.strategy`: replicas in sync, global batch size,
  worker identity (re-exported here).
- `keras_mgpu.distribute.multi_worker_fit`: `enable_multi_worker_fit()`, the
  explicit fix that makes Keras 3 `model.fit` work under
  `MultiWorkerMirroredStrategy` (keras-team/keras#20585).
- `keras_mgpu.distribute.cluster` (JAX): `start_cluster()`, a multi-process
  JAX cluster from Keras's, `TF_CONFIG`'s or Slurm's variables.
- `keras_mgpu.distribute.process_data` (JAX): `shard_across_processes()`,
  each process's slice of every global batch for a multi-process `fit`.
"""

from __future__ import annotations

from keras_mgpu.distribute.cluster import (
    ClusterSpec,
    cluster_from_environment,
    start_cluster,
)
from keras_mgpu.distribute.multi_worker_fit import (
    MultiWorkerFitWarning,
    disable_multi_worker_fit,
    enable_multi_worker_fit,
    multi_worker_fit_enabled,
)
from keras_mgpu.distribute.process_data import shard_across_processes
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
    "ClusterSpec",
    "MultiWorkerFitWarning",
    "accumulation_steps_of",
    "cluster_from_environment",
    "current_strategy",
    "disable_multi_worker_fit",
    "enable_multi_worker_fit",
    "global_batch_size",
    "is_multi_worker",
    "multi_worker_fit_enabled",
    "num_replicas_in_sync",
    "shard_across_processes",
    "start_cluster",
    "strategy_kind",
    "worker_info",
]

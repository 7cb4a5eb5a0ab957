"""Every worker of a multi-worker cluster gets the same search result."""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_mgpu.distribute import strategy_kind, worker_info


def is_multi_worker(strategy: Any) -> bool:
    """Whether `strategy` runs synchronous replicas in several processes."""
    return (
        strategy_kind(strategy) == "multi_worker_mirrored"
        and worker_info(strategy)["num_workers"] > 1
    )


def gather_rows(strategy: Any, row: np.ndarray) -> np.ndarray:
    """Every worker's `row` (float64), as a `[num_workers, len(row)]`
    matrix on every worker, in task order.

    Every worker must call this at the same point. One worker per task
    fills its own row of a zero matrix; a SUM all-reduce across the
    cluster then gives each worker the whole matrix exactly (each cell has
    one non-zero term). Without several workers, returns `row[None]`.
    """
    row = np.asarray(row, dtype=np.float64)
    if not is_multi_worker(strategy):
        return row[None]
    from keras_mgpu._flavour import tf

    info = worker_info(strategy)
    matrix = np.zeros((info["num_workers"], row.size), dtype=np.float64)
    matrix[int(info["task_id"] or 0)] = row
    local = len(strategy.extended.worker_devices)
    with strategy.scope():
        value = tf.constant(matrix)
        zeros = tf.zeros_like(value)

        def per_replica(context):
            # One replica per worker contributes: the sum counts each
            # worker once, however many devices it has.
            first = context.replica_id_in_sync_group % local == 0
            return value if first else zeros

        distributed = strategy.experimental_distribute_values_from_function(
            per_replica
        )
        total = strategy.reduce(
            tf.distribute.ReduceOp.SUM, distributed, axis=None
        )
    return np.asarray(total)

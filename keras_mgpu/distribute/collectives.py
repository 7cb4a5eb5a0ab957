"""Small eager collectives across the workers of a cluster.

Used between training steps (monitor figures at the end of an epoch, a
shared shuffle seed at the start of `fit`), never inside a step. Every
worker must call them at the same point of the program, as with any
collective.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def sum_over_workers(strategy: Any, matrix: np.ndarray) -> np.ndarray:
    """SUM of `matrix` over workers (not over each worker's local replicas).

    One replica per worker contributes its `matrix`, the others zeros, so
    each worker counts once however many devices it has. Give every worker
    its own row of a zero matrix to gather rows: float64 sums of one
    non-zero term per cell are exact.
    """
    import tensorflow as tf

    local = strategy.extended.worker_devices
    value = tf.constant(matrix)
    zeros = tf.zeros_like(value)

    def per_replica(context):
        first = context.replica_id_in_sync_group % len(local) == 0
        return value if first else zeros

    distributed = strategy.experimental_distribute_values_from_function(
        per_replica
    )
    return np.asarray(
        strategy.reduce(tf.distribute.ReduceOp.SUM, distributed, axis=None)
    )


def gather_rows(strategy: Any, row: np.ndarray) -> np.ndarray:
    """Every worker's `row` as a `[num_workers, len(row)]` float64 matrix,
    in rank order (`worker_info(strategy)["rank"]`: the chief, then the
    workers), on every worker (`row[None]` without several workers).

    Every worker must call it at the same point: one SUM all-reduce of a
    zero matrix in which each worker filled its own row, exact in float64.
    """
    from keras_mgpu.distribute.strategy import is_multi_worker, worker_info

    row = np.asarray(row, dtype=np.float64).reshape(-1)
    if not is_multi_worker(strategy):
        return row[None]
    info = worker_info(strategy)
    matrix = np.zeros((info["num_workers"], row.size), dtype=np.float64)
    matrix[info["rank"]] = row
    return sum_over_workers(strategy, matrix)

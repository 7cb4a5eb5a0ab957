"""Strategy helpers: replicas in sync, global batch size, worker identity.

These read the `tf.distribute` strategy in scope (or the one given), so the
same code gives the right figures on one device, under `MirroredStrategy`,
and on every worker of a `MultiWorkerMirroredStrategy` cluster.
"""

from __future__ import annotations

import json
import os
from typing import Any

from keras_mgpu._flavour import tf
from keras_mgpu._validation import check_int


def current_strategy(
    strategy: tf.distribute.Strategy | None = None,
) -> tf.distribute.Strategy:
    """The strategy given, or the one in scope (default strategy if none)."""
    return strategy if strategy is not None else tf.distribute.get_strategy()


def num_replicas_in_sync(strategy: tf.distribute.Strategy | None = None) -> int:
    """Number of replicas that each compute a slice of the global batch.

    Under `MultiWorkerMirroredStrategy` this counts the replicas of every
    worker. Under `ParameterServerStrategy`, each worker steps on its own, so
    one step covers one replica's batch: this returns 1 there.
    """
    strategy = current_strategy(strategy)
    if strategy_kind(strategy) == "parameter_server":
        return 1
    return int(strategy.num_replicas_in_sync)


def accumulation_steps_of(optimizer: Any) -> int:
    """Micro-steps per update of `optimizer` (1 unless it accumulates).

    Looks through wrappers (e.g. Keras's `LossScaleOptimizer`) for a
    `GradientAccumulationOptimizer`, and reads Keras's own
    `gradient_accumulation_steps` too.
    """
    seen = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        steps = getattr(optimizer, "accumulation_steps", None)
        if isinstance(steps, int) and steps >= 1:
            return steps
        builtin = getattr(optimizer, "gradient_accumulation_steps", None)
        if isinstance(builtin, int) and builtin > 1:
            return builtin
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return 1


def global_batch_size(
    per_replica_batch_size: int,
    strategy: tf.distribute.Strategy | None = None,
    accumulation_steps: int | Any = 1,
) -> int:
    """Examples that contribute to one optimizer update.

    `per_replica_batch_size × replicas in sync × accumulation steps`.

    Args:
        per_replica_batch_size: int, the batch each replica sees per step.
        strategy: the strategy to read; defaults to the one in scope.
        accumulation_steps: int, or an optimizer whose accumulation steps
            are read (see `accumulation_steps_of`). Defaults to 1.

    Example:

    ```python
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        gbs = keras_mgpu.global_batch_size(32, accumulation_steps=4)
    ```
    """
    check_int(per_replica_batch_size, "per_replica_batch_size", minimum=1)
    if not isinstance(accumulation_steps, int) or isinstance(
        accumulation_steps, bool
    ):
        accumulation_steps = accumulation_steps_of(accumulation_steps)
    check_int(accumulation_steps, "accumulation_steps", minimum=1)
    return (
        per_replica_batch_size
        * num_replicas_in_sync(strategy)
        * accumulation_steps
    )


def strategy_kind(strategy: tf.distribute.Strategy | None = None) -> str:
    """A short name for the strategy's kind.

    One of "default", "one_device", "mirrored", "central_storage",
    "multi_worker_mirrored", "parameter_server", "tpu" or "other".
    """
    strategy = current_strategy(strategy)
    name = type(strategy).__name__
    if not tf.distribute.has_strategy() and strategy is (
        tf.distribute.get_strategy()
    ):
        return "default"
    table = {
        "_DefaultDistributionStrategy": "default",
        "OneDeviceStrategy": "one_device",
        "OneDeviceStrategyV1": "one_device",
        "MirroredStrategy": "mirrored",
        "MirroredStrategyV1": "mirrored",
        "CentralStorageStrategy": "central_storage",
        "CentralStorageStrategyV1": "central_storage",
        "MultiWorkerMirroredStrategy": "multi_worker_mirrored",
        "CollectiveAllReduceStrategy": "multi_worker_mirrored",
        "_CollectiveAllReduceStrategyExperimental": "multi_worker_mirrored",
        "ParameterServerStrategyV2": "parameter_server",
        "ParameterServerStrategy": "parameter_server",
        "TPUStrategy": "tpu",
        "TPUStrategyV2": "tpu",
    }
    return table.get(name, "other")


def is_multi_worker(strategy: tf.distribute.Strategy | None = None) -> bool:
    """Whether `strategy` runs synchronous replicas in several worker
    processes (a `MultiWorkerMirroredStrategy` cluster of 2+ workers)."""
    strategy = current_strategy(strategy)
    return (
        strategy_kind(strategy) == "multi_worker_mirrored"
        and worker_info(strategy)["num_workers"] > 1
    )


def worker_info(
    strategy: tf.distribute.Strategy | None = None,
) -> dict[str, Any]:
    """This process's place in the cluster.

    Returns a dict with `task_type`, `task_id`, `num_workers` and `is_chief`
    (True on the single process of a one-machine run, and on worker 0 or the
    `chief` task of a cluster).
    """
    strategy = current_strategy(strategy)
    resolver = getattr(strategy, "cluster_resolver", None)
    task_type = getattr(resolver, "task_type", None)
    task_id = getattr(resolver, "task_id", None)
    num_workers = 1
    cluster: dict[str, Any] = {}
    if resolver is not None:
        try:
            cluster = resolver.cluster_spec().as_dict()
        except Exception:  # a resolver without a cluster: one machine
            cluster = {}
    elif os.environ.get("TF_CONFIG"):
        config = json.loads(os.environ["TF_CONFIG"])
        cluster = config.get("cluster", {})
        task_type = config.get("task", {}).get("type")
        task_id = config.get("task", {}).get("index")
    if cluster:
        num_workers = len(cluster.get("worker", [])) + len(
            cluster.get("chief", [])
        )
    if task_type in (None, "chief"):
        is_chief = True
    else:
        is_chief = (
            task_type == "worker" and task_id == 0 and ("chief" not in cluster)
        )
    return {
        "task_type": task_type,
        "task_id": task_id,
        "num_workers": max(num_workers, 1),
        "is_chief": is_chief,
    }

"""Strategy helpers: replicas in sync, global batch size, worker identity.

On TensorFlow these read the `tf.distribute` strategy in scope (or the one
given), so the same code gives the right figures on one device, under
`MirroredStrategy`, and on every worker of a `MultiWorkerMirroredStrategy`
cluster. On JAX they read the `keras.distribution` in force (or the one given
as `strategy`): its data-parallel size counts every process's devices.
"""

from __future__ import annotations

import json
import os
from typing import Any

from keras_mgpu import backend
from keras_mgpu._flavour import tf
from keras_mgpu._validation import check_int


def current_strategy(
    strategy: tf.distribute.Strategy | None = None,
) -> tf.distribute.Strategy:
    """The strategy given, or the one in scope (default strategy if none).

    On JAX: the `keras.distribution` given, or the one in force (None).
    """
    if backend.is_jax():
        from keras_mgpu.backend.jax import distribution

        return distribution.current_distribution(strategy)
    return strategy if strategy is not None else tf.distribute.get_strategy()


def num_replicas_in_sync(strategy: tf.distribute.Strategy | None = None) -> int:
    """Number of replicas that each compute a slice of the global batch.

    Under `MultiWorkerMirroredStrategy` this counts the replicas of every
    worker. Under `ParameterServerStrategy`, each worker steps on its own, so
    one step covers one replica's batch: this returns 1 there. On JAX: the
    size of the batch axis of the `keras.distribution`'s mesh (every device
    for `DataParallel`, across processes; 1 without a distribution).
    """
    if backend.is_jax():
        from keras_mgpu.backend.jax import distribution

        return distribution.data_parallel_size(strategy)
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
    "multi_worker_mirrored", "parameter_server", "tpu" or "other". On JAX:
    "default", "data_parallel", "model_parallel" or "other".
    """
    if backend.is_jax():
        from keras_mgpu.backend.jax import distribution

        return distribution.distribution_kind(strategy)
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
    processes (a `MultiWorkerMirroredStrategy` cluster of 2+ workers, seen
    from one of its members: an `evaluator` task trains nothing with the
    others). On JAX: whether JAX runs several processes."""
    if backend.is_jax():
        return worker_info(strategy)["num_workers"] > 1
    strategy = current_strategy(strategy)
    if strategy_kind(strategy) != "multi_worker_mirrored":
        return False
    info = worker_info(strategy)
    return info["num_workers"] > 1 and info["rank"] is not None


def worker_info(
    strategy: tf.distribute.Strategy | None = None,
) -> dict[str, Any]:
    """This process's place in the cluster.

    A task is identified by its `(task type, index)`: in a `TF_CONFIG` with
    a `chief` and `worker` tasks (Kubeflow's TFJob, TensorFlow's guides),
    `chief:0` and `worker:0` are two processes. Every keras_mgpu component
    reads identity here, never from the index alone.

    Returns a dict with
    - `task_type`, `task_id`: as in `TF_CONFIG` (None on one machine);
    - `rank`: this task's position among the collective members, in the
      order `MultiWorkerMirroredStrategy` uses (the chief first, then the
      workers by index): 0 .. num_workers - 1; None for a task that is not
      a member (an `evaluator`);
    - `num_workers`: collective members (`chief` + `worker` tasks);
    - `is_chief`: True on the single process of a one-machine run, on the
      `chief` task, and on `worker:0` of a cluster without a chief;
    - `task_name`: "chief:0", "worker:1", ... ("local" on one machine).

    On JAX the processes of `jax.distributed` (started by
    `keras.distribution.initialize`): `rank` is `jax.process_index()`,
    `num_workers` `jax.process_count()`, process 0 the chief, `task_name`
    "process:1" ("local" for one process).
    """
    if backend.is_jax():
        from keras_mgpu.backend.jax import distribution

        return distribution.process_info()
    strategy = current_strategy(strategy)
    task_type, task_id, cluster = _cluster_of(strategy)
    return task_identity(cluster, task_type, task_id)


def _cluster_of(strategy: Any) -> tuple[Any, Any, dict[str, Any]]:
    resolver = getattr(strategy, "cluster_resolver", None)
    task_type = getattr(resolver, "task_type", None)
    task_id = getattr(resolver, "task_id", None)
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
    return task_type, task_id, cluster


def task_identity(
    cluster: dict[str, Any], task_type: str | None, task_id: int | None
) -> dict[str, Any]:
    """`worker_info` for a task of a cluster spec (`{"chief": [...],
    "worker": [...], "evaluator": [...]}`), without a strategy."""
    members = cluster_members(cluster)
    num_workers = max(len(members), 1)
    index = int(task_id or 0)
    if task_type is None or not members:
        rank: int | None = 0
    elif (task_type, index) in [(t, i) for t, i, _ in members]:
        rank = [(t, i) for t, i, _ in members].index((task_type, index))
    else:
        rank = None  # an evaluator or another non-member task
    has_chief = bool(cluster.get("chief"))
    is_chief = task_type in (None, "chief") or (
        task_type == "worker" and index == 0 and not has_chief
    )
    return {
        "task_type": task_type,
        "task_id": task_id,
        "rank": rank,
        "num_workers": num_workers,
        "is_chief": is_chief,
        "task_name": "local" if task_type is None else f"{task_type}:{index}",
    }


def cluster_members(cluster: dict[str, Any]) -> list[tuple[str, int, str]]:
    """The collective members of a cluster spec as `(task type, index,
    address)`, in rank order: the chief, then the workers (as
    `MultiWorkerMirroredStrategy` orders them; `evaluator` and `ps` tasks
    are not members)."""
    members = []
    for task_type in ("chief", "worker"):
        tasks = cluster.get(task_type) or []
        if isinstance(tasks, dict):  # sparse specs: {index: address}
            items = sorted((int(k), v) for k, v in tasks.items())
        else:
            items = list(enumerate(tasks))
        members += [(task_type, i, str(address)) for i, address in items]
    return members


def member_names(strategy: tf.distribute.Strategy | None = None) -> list[str]:
    """ "chief:0 (host:port)", "worker:0 (host:port)", ... by rank."""
    _, _, cluster = _cluster_of(current_strategy(strategy))
    members = cluster_members(cluster)
    if not members:
        return ["local"]
    return [f"{t}:{i} ({address})" for t, i, address in members]

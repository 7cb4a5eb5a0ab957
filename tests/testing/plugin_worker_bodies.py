"""Functions `keras_mgpu.testing.run_workers` runs in worker processes."""

from __future__ import annotations

import os
import time


def all_reduce_rank(scale: float) -> dict:
    import tensorflow as tf

    from keras_mgpu.distribute import worker_info

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    info = worker_info(strategy)
    value = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(scale * (info["rank"] + 1))
    )
    total = strategy.reduce("SUM", value, axis=None)
    return {
        "task": info["task_name"],
        "rank": info["rank"],
        "sum": float(total),
        "devices": len(tf.config.list_logical_devices("CPU")),
    }


def sleep_forever(pid_file: str) -> None:
    with open(pid_file + f".{os.getpid()}", "w") as f:
        f.write(str(os.getpid()))
    while True:
        time.sleep(1)


def fail_on_worker_one() -> str:
    import json

    task = json.loads(os.environ["TF_CONFIG"])["task"]
    if task["index"] == 1:
        raise ValueError("boom on worker 1")
    time.sleep(600)  # the peer waits: run_workers must stop it
    return "unreachable"

"""Process bodies for tests/distribute/test_cluster_shapes.py: one `fit`
with every keras_mgpu callback, in the clusters `TF_CONFIG` is written as in
the wild (worker-only, `chief` + `worker`, plus an `evaluator` task).

A collective member trains with the cluster. The evaluator is no member:
TensorFlow gives it a `MultiWorkerMirroredStrategy` of its own (one worker,
outside the coordination service), so it runs the same script alone, as a
sidecar evaluator would, and every keras_mgpu callback must behave there as
on one machine (nothing gathered, nothing waited for, its own logs).
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings

from distribute._tiny_regression import compiled_model, data

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAMPLES = 48
GLOBAL_BATCH = 12  # 4 steps per epoch; divisible by 2 and 3 workers
EPOCHS = 2
BASE_BATCH = 6  # LearningRateScaler: 2x the base learning rate
WARMUP = 3  # updates


def _data():
    return data(SAMPLES, 3)


def _model():
    return compiled_model(
        11, lambda keras: keras.optimizers.SGD(0.05, momentum=0.5)
    )


def _lr_callbacks(per_replica: int) -> list:
    from keras_mgpu.callbacks import LearningRateScaler, LearningRateWarmup

    return [
        LearningRateScaler(
            base_batch_size=BASE_BATCH, per_replica_batch_size=per_replica
        ),
        LearningRateWarmup(warmup_steps=WARMUP),
    ]


def _weights(model) -> list:
    return [w.tolist() for w in model.get_weights()]


def _finite(value) -> bool:
    return isinstance(value, float) and math.isfinite(value)


def reference() -> list:
    """One process, no strategy, the global batch: the weights every
    cluster shape must reach."""
    model = _model()
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            validation_data=(x[:12], y[:12]),
            callbacks=_lr_callbacks(GLOBAL_BATCH),
        )
    return _weights(model)


def train_all_callbacks(position: int, backup_root: str) -> dict:
    """Every keras_mgpu callback in one `fit` (validation included), then
    `evaluate` and `predict` with the watchdog, in whatever task this
    process is."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras_mgpu
    from keras_mgpu.callbacks import (
        BackupAndRestore,
        GPULoadMonitor,
        MemoryMonitor,
        StragglerMonitor,
        WorkerWatchdog,
    )
    from keras_mgpu.distribute import worker_info

    keras_mgpu.distribute.enable_multi_worker_fit()
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    info = worker_info(strategy)
    with strategy.scope():
        model = _model()
    x, y = _data()
    per_replica = GLOBAL_BATCH // strategy.num_replicas_in_sync
    # Each task names its own backup directory only when it is alone (the
    # evaluator); the members share one, as BackupAndRestore expects.
    backup = os.path.join(
        backup_root,
        "evaluator" if task["type"] == "evaluator" else "cluster",
    )
    watchdog = WorkerWatchdog(timeout=60.0, heartbeat_interval=0.5)
    straggler = StragglerMonitor(warn_ratio=None)
    callbacks = [
        BackupAndRestore(backup),
        watchdog,
        straggler,
        MemoryMonitor(gather_workers=True),
        GPULoadMonitor(interval=0.05, gather_workers=True),
        *_lr_callbacks(per_replica),
    ]
    began = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            validation_data=(x[:12], y[:12]),
            callbacks=callbacks,
        )
        fitted = time.monotonic()
        loss = model.evaluate(
            x, y, batch_size=GLOBAL_BATCH, verbose=0, callbacks=[watchdog]
        )
        predicted = model.predict(
            x[:12], batch_size=GLOBAL_BATCH, verbose=0, callbacks=[watchdog]
        )
    ended = time.monotonic()
    last = {k: v[-1] for k, v in history.history.items()}
    return {
        "task": f"{task['type']}:{task['index']}",
        "rank": info.get("rank", info.get("task_id")),
        "replicas": int(strategy.num_replicas_in_sync),
        "log_keys": sorted(last),
        "finite_keys": sorted(k for k, v in last.items() if _finite(v)),
        "logs": {k: v for k, v in last.items() if _finite(v)},
        "weights": _weights(model),
        "loss": float(loss),
        "predicted": predicted.tolist(),
        "watchdog_report": watchdog.report,
        "straggler_keys": list(straggler.keys),
        "warnings": sorted({str(w.message)[:200] for w in caught}),
        # Files, not the directory: tf_keras's own BackupAndRestore (which
        # keras_mgpu's hands over to there) leaves it empty.
        "backup_left": sorted(
            os.path.relpath(os.path.join(root, name), backup)
            for root, _, names in os.walk(backup)
            for name in names
        ),
        "seconds": {"fit": fitted - began, "evaluate_predict": ended - fitted},
        "reference": reference() if position == 0 else None,
    }

"""Worker bodies for tests/distribute/test_worker_failures.py (and its
tf_keras twin in tests/legacy): a worker killed or stalled in the middle of
`fit`, then the whole job restarted from the chief's backup.

Each body returns what happened instead of raising, so the test harness
gets every worker's result even when training failed as intended.
"""

from __future__ import annotations

import json
import os
import signal
import time
import warnings

from distribute._tiny_regression import compiled_model, data

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAMPLES = 64
GLOBAL_BATCH = 8  # 8 steps per epoch
ACCUMULATION = 3  # windows straddle the epochs
EPOCHS = 4
WARMUP_UPDATES = 10  # of 10 updates in all: every backup is mid-warmup
# Worker 1 is killed (or stalls) at this (epoch, batch): micro-step 13 of
# the run, one micro-batch into a window, update 4 of the warmup.
STOP_AT = (1, 4)
WATCHDOG_TIMEOUT = 10.0
STALL_SECONDS = 16.0  # longer than the watchdog's timeout


def _data():
    return data(SAMPLES, 0)


def _compiled_model():
    from keras_mgpu import GradientAccumulationOptimizer

    return compiled_model(
        5,
        lambda keras: GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.5), ACCUMULATION
        ),
    )


def _stopper(mode: str):
    """A callback that kills or stalls this worker at `STOP_AT`."""
    from keras_mgpu._flavour import keras

    class Stop(keras.callbacks.Callback):
        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if (self.epoch, batch) != STOP_AT:
                return
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(STALL_SECONDS)  # alive but stuck: peers must not wait

    return Stop()


def _last_batch_end():
    from keras_mgpu._flavour import keras

    class LastBatchEnd(keras.callbacks.Callback):
        at = None

        def on_train_batch_end(self, batch, logs=None):
            self.at = time.monotonic()

    return LastBatchEnd()


def train(task_index: int, backup_dir: str, mode: str = "none") -> dict:
    """`mode`: "kill" or "stall" worker 1 at STOP_AT, or "none"."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras_mgpu
    from keras_mgpu.callbacks import (
        BackupAndRestore,
        LearningRateWarmup,
        MemoryMonitor,
        WorkerWatchdog,
    )

    keras_mgpu.distribute.enable_multi_worker_fit()
    with strategy.scope():
        model = _compiled_model()
    last = _last_batch_end()
    watchdog = WorkerWatchdog(timeout=WATCHDOG_TIMEOUT, heartbeat_interval=0.5)
    callbacks = [
        BackupAndRestore(backup_dir),
        LearningRateWarmup(warmup_steps=WARMUP_UPDATES),
        MemoryMonitor(gather_workers=True),
        watchdog,
        last,
    ]
    if mode != "none" and task_index == 1:
        callbacks.insert(0, _stopper(mode))
    x, y = _data()
    error, epochs_run = None, None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            history = model.fit(
                x,
                y,
                batch_size=GLOBAL_BATCH,
                epochs=EPOCHS,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
        epochs_run = history.epoch
    except Exception as exc:  # the failure under test
        error = f"{type(exc).__name__}: {exc}"[-3000:]
    failed_after = (
        time.monotonic() - last.at if error and last.at is not None else None
    )
    return {
        "error": error,
        "failed_after": failed_after,
        "report": watchdog.report,
        "epochs_run": epochs_run,
        "weights": [w.tolist() for w in model.get_weights()],
        "updates": int(model.optimizer.iterations.numpy()),
    }


def uninterrupted(task_index: int) -> dict:
    """The reference: one process, no strategy, the same run end to end."""
    import warnings

    from keras_mgpu.callbacks import LearningRateWarmup

    model = _compiled_model()
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
            callbacks=[LearningRateWarmup(warmup_steps=WARMUP_UPDATES)],
        )
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "updates": int(model.optimizer.iterations.numpy()),
    }


def _failing_load(fault, load):
    def failing(path, *args, **kwargs):
        reason = fault(path, None)
        if reason:
            raise OSError(reason)
        return load(path, *args, **kwargs)

    return failing


def restore_agreement(task_index: int, backup_dir: str) -> dict:
    """Worker 1 cannot load the latest backup, cannot load any, or loads
    other weights than the chief: what each worker does (item 5 of issue
    18). The backup: latest = end of epoch 2, previous = end of epoch 1."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras_mgpu
    from keras_mgpu._flavour import keras
    from keras_mgpu.callbacks import BackupAndRestore
    from keras_mgpu.distribute.strategy import worker_info

    keras_mgpu.distribute.enable_multi_worker_fit()
    rank = worker_info(strategy)["rank"]
    with strategy.scope():
        model = _compiled_model()
    x, y = _data()

    class StopAtEpoch2(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            if epoch == 2:
                raise RuntimeError("stop")  # on every worker, same point

    def fit(*extra):
        callback = BackupAndRestore(
            backup_dir, double_checkpoint=True, delete_checkpoint=False
        )
        started = time.monotonic()
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                history = model.fit(
                    x,
                    y,
                    batch_size=GLOBAL_BATCH,
                    epochs=3,
                    shuffle=False,
                    verbose=0,
                    callbacks=[callback, *extra],
                )
            return {"epochs": history.epoch, "error": None}
        except Exception as exc:  # the failure under test
            return {
                "error": f"{type(exc).__name__}: {exc}"[-2000:],
                "after": time.monotonic() - started,
            }

    fit(StopAtEpoch2())
    original = model.load_weights
    with open(os.path.join(backup_dir, "training_metadata.json")) as f:
        latest = json.load(f)["weights"]

    from keras_mgpu.callbacks import backup_and_restore as module

    check = getattr(module, "_check_readable", None)

    # Storage faults seen by worker 1 alone (a stale network mount, a
    # cache): it reads other bytes than the chief committed.
    def unreadable_latest(path, sha256):
        if os.path.basename(path) == latest:
            return "simulated: cannot read the latest backup"
        return check(path, sha256) if check else None

    def unreadable(path, sha256):
        return "simulated: cannot read any backup"

    def other_weights(path, *args, **kwargs):
        original(path, *args, **kwargs)
        first = model.weights[0]
        first.assign(first.numpy() + 1.0)

    results = {}
    for name, fault in (
        ("none_loadable", unreadable),
        ("other_weights", other_weights),
        ("latest_unreadable", unreadable_latest),
    ):
        if rank == 1 and name == "other_weights":
            model.load_weights = fault
        elif rank == 1 and check is None:
            # Code without a readability check (before issue 18): the
            # fault shows when worker 1 loads.
            model.load_weights = _failing_load(fault, original)
        elif rank == 1:
            module._check_readable = fault
        results[name] = fit()
        model.load_weights = original
        module._check_readable = check
        if name == "latest_unreadable":
            results[name]["weights"] = [w.tolist() for w in model.get_weights()]
    return results

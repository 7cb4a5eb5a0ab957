"""Worker bodies for tests/distribute/test_multi_worker_fit.py.

Each worker runs every scenario in one process (one cluster start for the
module) and returns what the test asserts on. References (the same training
in one process on the global batch, default strategy) are computed in the
worker too, outside the strategy's scope: the model is tiny.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAMPLES = 64
GLOBAL_BATCH = 8  # per micro-step, both workers (4 each)
FEATURES = 5


def _data(samples: int = SAMPLES, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, FEATURES)).astype("float32")
    w = rng.normal(size=(FEATURES, 1)).astype("float32")
    y = (np.tanh(x @ w) + 0.1 * rng.normal(size=(samples, 1))).astype("float32")
    return x, y


def _model(recompute: bool = False, seed: int = 7):
    import keras

    import keras_mgpu

    keras.utils.set_random_seed(seed)
    block = keras.Sequential(
        [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(16)],
        name="block",
    )
    if recompute:
        block = keras_mgpu.RecomputeGrad(block, name="block")
    return keras.Sequential(
        [keras.Input((FEATURES,)), block, keras.layers.Dense(1)]
    )


def _weights(model) -> list:
    return [w.tolist() for w in model.get_weights()]


def _plain_fit(x, y, batch_size, epochs, learning_rate=0.1):
    """The reference: one process, default strategy, the global batch."""
    import keras

    model = _model()
    model.compile(optimizer=keras.optimizers.SGD(learning_rate), loss="mse")
    model.fit(
        x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0
    )
    return model


def _error(fn) -> str | None:
    try:
        fn()
    except Exception as exc:  # the test asserts on the message
        text = f"{type(exc).__name__}: {exc}"
        return text if len(text) < 3000 else text[:1000] + text[-2000:]
    return None


def fit_scenarios(task_index: int) -> dict:
    import keras
    import numpy as np
    import tensorflow as tf

    import keras_mgpu

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    assert keras_mgpu.distribute.enable_multi_worker_fit()
    results: dict = {"replicas": strategy.num_replicas_in_sync}
    x, y = _data()

    # 1. Plain fit on arrays, evaluate and predict.
    with strategy.scope():
        model = _model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(
        x, y, batch_size=GLOBAL_BATCH, epochs=2, shuffle=False, verbose=0
    )
    reference = _plain_fit(x, y, GLOBAL_BATCH, 2)
    results["plain"] = {
        "weights": _weights(model),
        "reference": _weights(reference),
        "loss": history.history["loss"],
        "evaluate": float(model.evaluate(x, y, batch_size=16, verbose=0)),
        "evaluate_reference": float(
            reference.evaluate(x, y, batch_size=16, verbose=0)
        ),
        "predict": model.predict(x[:20], batch_size=8, verbose=0).tolist(),
        "predict_reference": reference.predict(x[:20], verbose=0).tolist(),
    }

    # 2. Every component: accumulation, scaling + warmup, both monitors
    #    gathering every worker's figures, a recomputed block.
    results["components"] = _components(strategy, x, y)

    # 3. Shuffling arrays: one epoch sees every sample exactly once.
    results["coverage"] = _coverage(strategy, task_index)

    # 4. Clear errors instead of obscure ones.
    with strategy.scope():
        model = _model()
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    results["steps_per_execution_error"] = _error(
        lambda: model.fit(x, y, batch_size=GLOBAL_BATCH, verbose=0)
    )
    # predict has no multi-step loop: steps_per_execution works there.
    results["predict_spe2"] = model.predict(x[:20], batch_size=8, verbose=0)
    results["predict_spe2"] = results["predict_spe2"].tolist()
    results["predict_spe2_reference"] = (
        _model().predict(x[:20], verbose=0).tolist()
    )
    with strategy.scope():
        model = _model()
        model.compile(optimizer="sgd", loss="mse")
    backup = keras.callbacks.BackupAndRestore(f"/tmp/unused_{task_index}")
    results["backup_error"] = _error(
        lambda: model.fit(x, y, batch_size=8, verbose=0, callbacks=[backup])
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.fit(x[:60], y[:60], batch_size=8, verbose=0, shuffle=False)
    results["partial_batch_warnings"] = [
        str(w.message)
        for w in caught
        if type(w.message).__name__ == "MultiWorkerFitWarning"
    ]
    results["tf_dataset"] = _dataset_fit(strategy, x, y)
    results["straggler"] = _straggler_run(strategy, task_index)
    # Last: Keras's own limits, with our checks bypassed (they may leave
    # the collectives unusable).
    results["keras_limits"] = _keras_limits(strategy, x, y)
    del np
    return results


STRAGGLER_SLEEP = 2.0


def _straggler_run(strategy, task_index: int) -> dict:
    """Worker 1 sleeps STRAGGLER_SLEEP s before each of 2 steps per epoch.

    The sleep is outside every collective, so it is a lower bound of
    worker 1's busy time per step whatever the load; it must also outlast
    worker 0's own work per step for worker 1 to be the slowest (a loaded
    worker 0 took 330 ms a step once; 2 s leaves a margin of 1.6 s)."""
    import time

    import keras

    from keras_mgpu.callbacks import StragglerMonitor

    class Sleep(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if task_index == 1:
                time.sleep(STRAGGLER_SLEEP)

    x, y = _data(64)
    with strategy.scope():
        model = _model()
        model.compile(optimizer="sgd", loss="mse")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x,
            y,
            batch_size=32,
            epochs=2,
            verbose=0,
            callbacks=[Sleep(), StragglerMonitor()],
        )
    return {
        "logs": {k: v[-1] for k, v in history.history.items() if k != "loss"},
        "warnings": [
            str(w.message) for w in caught if "Straggler" in str(w.message)
        ],
    }


def _keras_limits(strategy, x, y) -> dict:
    """What Keras does where enable_multi_worker_fit raises instead."""
    import json
    import tempfile

    import keras

    fit = keras.Model.fit.__wrapped__  # Keras's fit, without our checks
    port = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"][0]
    shared = os.path.join(
        tempfile.gettempdir(), f"keras_mgpu_limit_{port.split(':')[-1]}"
    )
    with strategy.scope():
        model = _model()
        model.compile(optimizer="sgd", loss="mse", steps_per_execution=2)
    steps = _error(lambda: fit(model, x, y, batch_size=8, verbose=0))
    backup = _serialised_backup(strategy, x, y, shared)
    return {"backup": backup, "steps_per_execution": steps}


# Files Keras 3's BackupAndRestore writes in its `backup_dir`.
BACKUP_FILES = ("latest.weights.h5", "training_metadata.json")


def _serialised_backup(strategy, x, y, shared: str) -> dict:
    """Keras's BackupAndRestore, the same `backup_dir` on both workers, with
    the two workers' epoch-end saves put one after the other.

    Unserialised, the outcome depends on who wins a race (measured: one
    worker fails with FileExistsError, BlockingIOError or an HDF5 lock
    error, or neither does). Serialised, it is fixed: worker 0 saves, then
    worker 1 saves over worker 0's backup. Before worker 1's save, its
    `_Gate` stamps the backup files' mtime to 0; after it, `_Done` lists
    those worker 1 rewrote (mtime no longer 0)."""
    import shutil
    import time

    import keras

    import keras_mgpu

    task = keras_mgpu.distribute.strategy.worker_info(strategy)
    gate_dir = shared + "_gate"
    for path in (shared, gate_dir):
        # No worker writes before both have run a step together.
        shutil.rmtree(path, ignore_errors=True)
    os.makedirs(gate_dir, exist_ok=True)
    rewritten: list = []
    files: list = []

    class _Gate(keras.callbacks.Callback):
        """Before the backup's save: worker 1 waits for worker 0's."""

        def on_epoch_end(self, epoch, logs=None):
            if task["rank"] != 1:
                return
            marker = os.path.join(gate_dir, f"saved_{epoch}")
            deadline = time.monotonic() + 120
            while not os.path.exists(marker):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"worker 0 never wrote {marker}")
                time.sleep(0.01)
            for name in BACKUP_FILES:
                os.utime(os.path.join(shared, name), ns=(0, 0))

    class _Done(keras.callbacks.Callback):
        """After the backup's save: what is in the shared directory; then
        worker 0 lets worker 1 go on."""

        def on_epoch_end(self, epoch, logs=None):
            files.append(sorted(os.listdir(shared)))
            if task["rank"] == 0:
                open(os.path.join(gate_dir, f"saved_{epoch}"), "w").close()
                return
            rewritten.append(
                [
                    name
                    for name in BACKUP_FILES
                    if os.stat(os.path.join(shared, name)).st_mtime_ns != 0
                ]
            )

    with strategy.scope():
        model = _model()
        model.compile(optimizer="sgd", loss="mse")
    fit = keras.Model.fit.__wrapped__  # Keras's fit, without our checks
    # The watchdog bounds the wait of a worker left alone in a collective,
    # should a Keras release make one worker fail here.
    error = _error(
        lambda: fit(
            model,
            x,
            y,
            batch_size=8,
            epochs=2,
            verbose=0,
            callbacks=[
                _Gate(),
                # Kept: removing it at train end would race with the peer.
                keras.callbacks.BackupAndRestore(
                    shared, delete_checkpoint=False
                ),
                _Done(),
                keras_mgpu.callbacks.WorkerWatchdog(timeout=10),
            ],
        )
    )
    if task["rank"] == 1:  # the last to touch them
        for path in (shared, gate_dir):
            shutil.rmtree(path, ignore_errors=True)
    return {
        "rank": task["rank"],
        "error": error,
        "files": files,
        "rewritten_by_worker_1": rewritten,
    }


def _components(strategy, x, y) -> dict:
    import keras

    import keras_mgpu
    from keras_mgpu.callbacks import (
        GPULoadMonitor,
        LearningRateScaler,
        LearningRateWarmup,
        MemoryMonitor,
        ThroughputMonitor,
    )

    steps = 2
    throughput = ThroughputMonitor(window_size=4)
    with strategy.scope():
        model = _model(recompute=True)
        model.compile(
            optimizer=keras_mgpu.GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.05, momentum=0.5), steps
            ),
            loss="mse",
        )
    per_replica = GLOBAL_BATCH // strategy.num_replicas_in_sync
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # monitors: no GPU here
        history = model.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            epochs=3,
            shuffle=False,
            verbose=0,
            callbacks=[
                LearningRateScaler(
                    base_batch_size=8, per_replica_batch_size=per_replica
                ),
                LearningRateWarmup(warmup_steps=6),
                MemoryMonitor(gather_workers=True),
                GPULoadMonitor(interval=0.05, gather_workers=True),
                throughput,
            ],
        )
    reference = _model()
    reference.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.5), loss="mse"
    )
    reference.fit(
        x,
        y,
        batch_size=GLOBAL_BATCH * steps,
        epochs=3,
        shuffle=False,
        verbose=0,
        callbacks=[
            LearningRateScaler(
                base_batch_size=8, per_replica_batch_size=GLOBAL_BATCH * steps
            ),
            LearningRateWarmup(warmup_steps=6),
        ],
    )
    return {
        "weights": _weights(model),
        "reference": _weights(reference),
        "updates": int(model.optimizer.iterations.numpy()),
        "log_keys": sorted(history.history),
        "learning_rate": history.history["learning_rate"],
        "throughput": dict(throughput.last),
    }


class _CountingModel:
    """Builds a Keras model that counts, per sample id, how often the
    cluster trained on it (an on-read SUM variable: each replica counts its
    own samples; reading sums every replica of every worker)."""

    @staticmethod
    def build(samples: int):
        import keras
        import tensorflow as tf

        class Counting(keras.Model):
            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(1)
                self.seen = keras.Variable(
                    initializer="zeros",
                    shape=(samples,),
                    trainable=False,
                    aggregation="sum",
                    synchronization="on_read",
                    name="seen",
                )

            def call(self, inputs):
                return self.dense(inputs[:, 1:])

            def train_step(self, data):
                ids = tf.cast(data[0][:, 0], tf.int32)
                counts = tf.math.bincount(
                    ids, minlength=samples, maxlength=samples
                )
                self.seen.assign_add(tf.cast(counts, self.seen.dtype))
                return super().train_step(data)

        return Counting()


def _coverage(strategy, task_index: int) -> dict:
    """Two fits, one epoch each: first with no global seed anywhere, then
    with a different seed on each worker (e.g. for augmentation)."""
    import numpy as np
    import tensorflow as tf

    samples = 64
    x, y = _data(samples, seed=3)
    ids = np.arange(samples, dtype="float32")[:, None]
    with strategy.scope():
        model = _CountingModel.build(samples)
        model.compile(optimizer="sgd", loss="mse")
    counts = []
    for seed in (None, 100 + task_index):
        tf.random.set_seed(seed)
        model.fit(
            np.concatenate([ids, x], axis=1),
            y,
            batch_size=8,
            epochs=1,
            shuffle=True,
            verbose=0,
        )
        counts.append(np.asarray(model.seen.numpy()).tolist())
    return {"counts": counts}


def _dataset_fit(strategy, x, y) -> dict:
    """A tf.data pipeline with unknown cardinality and validation data."""
    import keras
    import tensorflow as tf

    dataset = (
        tf.data.Dataset.from_tensor_slices((x, y))
        .filter(lambda a, b: True)  # unknown cardinality
        .batch(GLOBAL_BATCH)
    )
    with strategy.scope():
        model = _model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    history = model.fit(
        dataset, epochs=2, validation_data=(x[:16], y[:16]), verbose=0
    )
    reference = _plain_fit(x, y, GLOBAL_BATCH, 2)
    return {
        "weights": _weights(model),
        "reference": _weights(reference),
        "val_loss": history.history["val_loss"],
    }

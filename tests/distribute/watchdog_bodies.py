"""Process bodies for tests/distribute/test_watchdog_faults.py: a
`WorkerWatchdog` in 2-process clusters where one task starts late, stalls in
validation or `predict`, or is killed in `evaluate`.

Each body returns what happened instead of raising, so the harness gets
every process's result even when a call failed as intended.
"""

from __future__ import annotations

import json
import os
import signal
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAMPLES = 32
GLOBAL_BATCH = 8  # 4 steps per epoch
HEARTBEAT = 0.5  # stale_after: 5 s
TIMEOUT = 10.0  # the watchdog of the stall and kill runs
SLOW_TIMEOUT = 16.0  # the watchdog of the slow-start run
LATE_BY = 8.0  # the late task reaches training this much after the other
STALL = TIMEOUT + 4.0  # a stalled task sleeps this long


def _data():
    import numpy as np

    rng = np.random.default_rng(1)
    x = rng.normal(size=(SAMPLES, 5)).astype("float32")
    y = (x @ rng.normal(size=(5, 1))).astype("float32")
    return x, y


def _task() -> str:
    task = json.loads(os.environ["TF_CONFIG"])["task"]
    return f"{task['type']}:{task['index']}"


def _fault(hook: str, at_batch: int, action: str):
    """A callback (listed before the watchdog) that makes this process late
    ("late": sleeps LATE_BY s in `on_train_begin`), stall ("stall": sleeps
    STALL s) or die ("kill") in `hook` at batch `at_batch`. Each hook
    sleeps in its own frame: the watchdog names that function."""
    from keras_mgpu._flavour import keras

    def due(name: str, batch: int) -> bool:
        if name != hook or batch != at_batch:
            return False
        if action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        return True

    class Fault(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            if due("on_train_begin", at_batch):
                time.sleep(LATE_BY if action == "late" else STALL)

        def on_test_batch_begin(self, batch, logs=None):
            if due("on_test_batch_begin", batch):
                time.sleep(STALL)

        def on_predict_batch_begin(self, batch, logs=None):
            if due("on_predict_batch_begin", batch):
                time.sleep(STALL)

    return Fault()


class _Clock:
    """When this process began `fit`, finished its first train step, and
    last finished a batch of any kind."""

    def __init__(self):
        from keras_mgpu._flavour import keras

        clock = self
        self.at = self.began = self.first_step = None

        class Marks(keras.callbacks.Callback):
            def on_train_begin(self, logs=None):
                clock.began = time.monotonic()

            def on_train_batch_end(self, batch, logs=None):
                clock.at = time.monotonic()
                if clock.first_step is None:
                    clock.first_step = clock.at - clock.began

            def on_test_batch_end(self, batch, logs=None):
                clock.at = time.monotonic()

            def on_predict_batch_end(self, batch, logs=None):
                clock.at = time.monotonic()

        self.callback = Marks()


def _outcome(fn, clock: _Clock) -> dict:
    error = None
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn()
    except Exception as exc:  # the failure under test
        error = f"{type(exc).__name__}: {exc}"[-3000:]
    failed_after = (
        time.monotonic() - clock.at if error and clock.at is not None else None
    )
    return {"error": error, "failed_after": failed_after}


def _setup():
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras_mgpu
    from keras_mgpu._flavour import keras

    keras_mgpu.distribute.enable_multi_worker_fit()
    with strategy.scope():
        keras.utils.set_random_seed(2)
        model = keras.Sequential(
            [keras.Input((5,)), keras.layers.Dense(4), keras.layers.Dense(1)]
        )
        model.compile(optimizer="sgd", loss="mse")
    return model


def _key_present(run: str, rank: int) -> bool:
    """Whether this worker's status of `run` is still in the store."""
    from tensorflow.python.eager import context

    for slot in (0, 1):  # WorkerStatus writes two slots in turn
        try:
            context.context().get_config_key_value(
                f"keras_mgpu/worker_status/{run}/{rank}/{slot}", 200
            )
        except Exception:  # DeadlineExceeded: no such key
            continue
        return True
    return False


def late_start_then_predict_stall(position: int) -> dict:
    """Worker-only. fit 1 (plain); fit 2 where worker:1 reaches training
    LATE_BY s after worker:0 (with SLOW_TIMEOUT > stale_after: no abort);
    evaluate (plain); predict where worker:1 stalls at batch 1."""
    from keras_mgpu.callbacks import WorkerWatchdog

    model = _setup()
    x, y = _data()
    late = position == 1
    results = {"task": _task()}

    def fit(extra):
        clock = _Clock()
        watchdog = WorkerWatchdog(
            timeout=SLOW_TIMEOUT, heartbeat_interval=HEARTBEAT
        )
        out = _outcome(
            lambda: model.fit(
                x,
                y,
                batch_size=GLOBAL_BATCH,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=[*extra, watchdog, clock.callback],
            ),
            clock,
        )
        return {**out, "report": watchdog.report, "first": clock.first_step}

    results["fit1"] = fit([])
    results["fit1"]["own_key_left"] = _key_present("run0", position)
    extra = [_fault("on_train_begin", 0, "late")] if late else []
    results["fit2"] = fit(extra)
    watchdog = WorkerWatchdog(timeout=TIMEOUT, heartbeat_interval=HEARTBEAT)
    clock = _Clock()
    results["evaluate"] = _outcome(
        lambda: model.evaluate(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            verbose=0,
            callbacks=[watchdog, clock.callback],
        ),
        clock,
    )
    extra = [_fault("on_predict_batch_begin", 1, "stall")] if late else []
    watchdog = WorkerWatchdog(timeout=TIMEOUT, heartbeat_interval=HEARTBEAT)
    results["predict"] = _outcome(
        lambda: model.predict(
            x,
            batch_size=GLOBAL_BATCH,
            verbose=0,
            callbacks=[*extra, watchdog, clock.callback],
        ),
        clock,
    )
    results["predict"]["report"] = watchdog.report
    return results


def validation_stall(position: int) -> dict:
    """Chief + worker. worker:0 stalls in validation (epoch 0, batch 1);
    a StragglerMonitor is in the fit, whose hook must go when fit raises."""
    from keras_mgpu.callbacks import StragglerMonitor, WorkerWatchdog
    from keras_mgpu.distribute import collective_timing

    model = _setup()
    x, y = _data()
    clock = _Clock()
    watchdog = WorkerWatchdog(timeout=TIMEOUT, heartbeat_interval=HEARTBEAT)
    extra = [_fault("on_test_batch_begin", 1, "stall")] if position else []
    out = _outcome(
        lambda: model.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            epochs=2,
            shuffle=False,
            verbose=0,
            validation_data=(x, y),
            callbacks=[
                *extra,
                StragglerMonitor(),
                watchdog,
                clock.callback,
            ],
        ),
        clock,
    )
    from tensorflow.python.distribute import cross_device_utils

    launcher = cross_device_utils.CollectiveReplicaLauncher
    return {
        **out,
        "task": _task(),
        "report": watchdog.report,
        "hook_left": collective_timing.installed()
        or hasattr(launcher.all_reduce, "__wrapped__"),
    }


def evaluate_kill(position: int) -> dict:
    """Chief + worker. fit (plain), then worker:0 is killed in `evaluate`
    (batch 1)."""
    from keras_mgpu.callbacks import WorkerWatchdog

    model = _setup()
    x, y = _data()
    watchdog = WorkerWatchdog(timeout=TIMEOUT, heartbeat_interval=HEARTBEAT)
    clock = _Clock()
    fitted = _outcome(
        lambda: model.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            epochs=1,
            verbose=0,
            callbacks=[watchdog, clock.callback],
        ),
        clock,
    )
    extra = [_fault("on_test_batch_begin", 1, "kill")] if position else []
    out = _outcome(
        lambda: model.evaluate(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            verbose=0,
            callbacks=[*extra, watchdog, clock.callback],
        ),
        clock,
    )
    return {**out, "fit": fitted, "task": _task(), "report": watchdog.report}

"""Process bodies for tests/distribute/test_jax_monitors_jax.py: JAX's
key-value store, `StragglerMonitor`, `MemoryMonitor(gather_workers=True)`
and `WorkerWatchdog` across the 2 processes x 2 CPU devices of a JAX
cluster.

`monitors_then_stall` runs every scenario that keeps the cluster alive,
saves what it saw (`<out>/<rank>.pkl`), then process 1 stalls in a callback
and process 0's watchdog ends the run. `kill` SIGKILLs (or SIGSTOPs)
process 1 before a step.
Moments that the test compares with a process's end are written to
`<out>/<name>` as wall-clock times (one host, one clock).
"""

from __future__ import annotations

import os
import pickle
import signal
import time
import warnings

SAMPLES = 64
BATCH = 8  # global: 8 steps per epoch
EPOCHS = 2
SLOW = 0.1  # seconds process 1 spends in a callback after each step
HEARTBEAT = 0.5  # stale_after: 5 s
STALL_TIMEOUT = 6.0  # the watchdog of the stall run
KILL_TIMEOUT = 30.0  # the watchdog of the kill run (stale_after decides)
STALL = 60.0  # a stalled process sleeps this long (it is ended before)
FAULT_BATCH = 2  # the fault comes before the third step


def _rank() -> int:
    import jax

    return int(jax.process_index())


def _distribute() -> int:
    """Train on every process's devices from now on; this process's rank."""
    import jax
    import keras

    keras.distribution.set_distribution(
        keras.distribution.DataParallel(
            devices=jax.devices(), auto_shard_dataset=False
        )
    )
    return _rank()


def _mark(out: str, name: str) -> None:
    """Write the wall time now to `<out>/<name>`, durably."""
    path = os.path.join(out, name)
    with open(path + ".tmp", "w") as f:
        f.write(repr(time.time()))
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _barrier() -> None:
    import numpy as np

    from keras_mgpu.backend.jax.processes import allgather_rows

    allgather_rows(np.zeros(1))


def _data():
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 3)).astype("float32")
    y = (x @ np.array([[0.5], [-1.0], [2.0]], "float32")).astype("float32")
    return x, y


def _model():
    import keras

    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4), keras.layers.Dense(1)]
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


def _fit(model, epochs, callbacks):
    from keras_mgpu.distribute import shard_across_processes

    x, y = _data()
    return model.fit(
        shard_across_processes(x, y, batch_size=BATCH, shuffle=False),
        epochs=epochs,
        verbose=0,
        callbacks=callbacks,
    )


def _fault(action: str, out: str):
    """A callback, listed before the watchdog, that makes process 1 stall
    (sleep STALL s), die (SIGKILL) or freeze (SIGSTOP: every thread
    stops, its heartbeat too) before step FAULT_BATCH + 1, and
    marks when process 0 starts that step."""
    import keras

    rank = _rank()

    class Fault(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            if batch != FAULT_BATCH:
                return
            if rank == 0:
                _mark(out, "waiting_since")
            elif action in ("kill", "freeze"):
                _mark(out, "killed_at")
                os.kill(
                    os.getpid(),
                    signal.SIGKILL if action == "kill" else signal.SIGSTOP,
                )
            else:
                time.sleep(STALL)

    return Fault()


def _slow_callback():
    import keras

    class Slow(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            time.sleep(SLOW)

    return Slow()


class _RankPsutil:
    """psutil with this process's rank in its figures, so the gathered
    figures show which process each came from."""

    def __init__(self, rank: int) -> None:
        from monitoring._monitor_fakes import FakePsutil

        self._fake = FakePsutil(rss_mb=100 + rank, available_mb=6000 + rank)

    def __getattr__(self, name):
        return getattr(self._fake, name)


def _kv_store_round_trip(rank: int) -> dict:
    from keras_mgpu.backend.jax.kv_store import JaxKeyValueStore

    store = JaxKeyValueStore()
    folder = f"keras_mgpu_test/{rank}"
    store.set(f"{folder}/a", "first")
    store.set(f"{folder}/a", "second")  # overwrites
    seen = {"own": store.get(f"{folder}/a", 1.0)}
    seen["missing"] = store.get(f"{folder}/none", 1.0)
    _barrier()
    peer = 1 - rank
    seen["peer"] = store.get(f"keras_mgpu_test/{peer}/a", 1.0)
    seen["listed"] = sorted(store.items("keras_mgpu_test"))
    _barrier()
    store.delete(folder)
    store.delete(f"{folder}/never_set")  # nothing to delete: no error
    _barrier()
    seen["after_delete"] = store.items("keras_mgpu_test")
    return seen


def _monitored_fit(rank: int) -> dict:
    from keras_mgpu.backend.jax.kv_store import JaxKeyValueStore
    from keras_mgpu.callbacks import (
        GPULoadMonitor,
        MemoryMonitor,
        StragglerMonitor,
        ThroughputMonitor,
        WorkerWatchdog,
    )
    from keras_mgpu.monitoring import HostBackend

    model = _model()
    _fit(model, 1, [])  # compiles the step: no compile time in the timing
    untimed = model.train_function
    memory = MemoryMonitor(gather_workers=True)
    memory._host_backend = HostBackend(psutil_module=_RankPsutil(rank))
    straggler = StragglerMonitor(warn_ratio=1.25)
    watchdog = WorkerWatchdog(timeout=30.0, heartbeat_interval=HEARTBEAT)
    throughput = ThroughputMonitor(window_size=4)
    callbacks = [
        straggler,
        memory,
        GPULoadMonitor(interval=0.05, gather_workers=True),
        throughput,
        watchdog,
    ]
    if rank == 1:
        callbacks.insert(0, _slow_callback())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = _fit(model, EPOCHS, callbacks)
    _barrier()  # both fits ended: their statuses are deleted
    left = JaxKeyValueStore().items("keras_mgpu/worker_status")
    return {
        "history": {k: list(v) for k, v in history.history.items()},
        "straggler_keys": list(straggler.keys),
        "memory_keys": list(memory.keys),
        "throughput": dict(throughput.last),
        "warnings": [str(w.message) for w in caught],
        "train_function_restored": model.train_function is untimed,
        "watchdog_report": watchdog.report,
        "statuses_left": left,
    }


def monitors_then_stall(out: str) -> None:
    from keras_mgpu.callbacks import WorkerWatchdog
    from keras_mgpu.distribute import worker_info

    rank = _distribute()
    seen = {"worker_info": worker_info()}
    seen["kv"] = _kv_store_round_trip(rank)
    seen["fit"] = _monitored_fit(rank)
    with open(os.path.join(out, f"{rank}.pkl"), "wb") as f:
        pickle.dump(seen, f)
    _barrier()
    # The stall: process 1 sleeps in a callback; process 0 waits in its
    # step, its watchdog names process 1 after STALL_TIMEOUT and ends it.
    model = _model()
    _fit(model, 1, [])  # compiled before the watched fit
    watchdog = WorkerWatchdog(
        timeout=STALL_TIMEOUT, heartbeat_interval=HEARTBEAT
    )
    _fit(model, 1, [_fault("stall", out), watchdog])
    _mark(out, f"stall_fit_returned_{rank}")  # must never happen


def kill(out: str, action: str = "kill") -> None:
    """Process 1 is SIGKILLed ("kill") or SIGSTOPped ("freeze") in a
    watched fit."""
    from keras_mgpu.callbacks import WorkerWatchdog

    _distribute()
    model = _model()  # compiled in the watched fit: KILL_TIMEOUT covers it
    watchdog = WorkerWatchdog(
        timeout=KILL_TIMEOUT, heartbeat_interval=HEARTBEAT
    )
    _fit(model, 1, [_fault(action, out), watchdog])
    _mark(out, f"kill_fit_returned_{_rank()}")  # must never happen

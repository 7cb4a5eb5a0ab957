"""Multi-worker Keras 3 `fit`: what the failure and straggler tooling costs,
and what `steps_per_execution` would buy.

Starts 2 worker processes on 127.0.0.1 (MultiWorkerMirroredStrategy, one
CPU device each) and, in one cluster, times epochs of `model.fit` on an MLP
with `enable_multi_worker_fit()`:

- `plain`: no callback;
- `straggler`: `StragglerMonitor` (timestamps around every collective);
- `watchdog`: `WorkerWatchdog` (heartbeats to the coordination service);
- `all`: both, plus `BackupAndRestore` (a save per epoch), both LR
  callbacks and `MemoryMonitor(gather_workers=True)`;
- `spe4_trace_time_keys`: `steps_per_execution=4` with TensorFlow's private
  trace-time collective keys, which keras_mgpu refuses to switch on (they
  mismatch silently if workers retrace at different times): the speed-up a
  user gives up. Run last: it changes how every later collective is keyed.

The cases are interleaved over `--repeats` rounds; each prints one JSON line
(median seconds per step over the rounds, steps after the first epoch) and
a last line gives each case's ratio to `plain`.

    python benchmarks/bench_multi_worker.py [--repeats 5] [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CASES = ("plain", "straggler", "watchdog", "all")


def _callbacks(case: str, backup: str) -> list:
    from keras_mgpu import callbacks

    if case == "plain":
        return []
    if case == "straggler":
        return [callbacks.StragglerMonitor(warn_ratio=None)]
    if case == "watchdog":
        return [callbacks.WorkerWatchdog(timeout=300)]
    return [
        callbacks.LearningRateScaler(
            base_batch_size=64, per_replica_batch_size=64
        ),
        callbacks.LearningRateWarmup(warmup_steps=10),
        callbacks.MemoryMonitor(gather_workers=True),
        callbacks.StragglerMonitor(warn_ratio=None),
        callbacks.WorkerWatchdog(timeout=300),
        callbacks.BackupAndRestore(backup, delete_checkpoint=True),
    ]


def _model(spe: int = 1):
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((256,)),
            keras.layers.Dense(1024, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer="adam",
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        steps_per_execution=spe,
    )
    return model


def _seconds_per_step(model, x, y, callbacks, fit=None) -> float:
    """Median of the epochs after the first (which traces)."""
    import keras

    class Timer(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    times: list[float] = []
    fit = fit or type(model).fit
    fit(
        model,
        x,
        y,
        batch_size=128,
        epochs=4,
        shuffle=False,
        verbose=0,
        callbacks=[Timer(), *callbacks],
    )
    steps = len(x) // 128
    return statistics.median(times[1:]) / steps


def worker(task: int, repeats: int, steps: int, backup: str) -> dict:
    import warnings

    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    import keras_mgpu

    keras_mgpu.distribute.enable_multi_worker_fit()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * 128, 256)).astype("float32")
    y = rng.integers(0, 10, size=(steps * 128,)).astype("int32")
    results: dict[str, list[float]] = {case: [] for case in CASES}
    warnings.simplefilter("ignore")
    for _ in range(repeats):
        for case in CASES:
            with strategy.scope():
                model = _model()
            results[case].append(
                _seconds_per_step(model, x, y, _callbacks(case, backup))
            )
    # Last: trace-time collective keys (private, TF 2.16-2.21) let Keras's
    # multi-step loop run; keras_mgpu refuses it (see the README).
    from tensorflow.python.distribute import cross_device_utils

    cross_device_utils.CollectiveReplicaLauncher._prefer_unique_instance_key = (
        False
    )
    results["spe1_trace_time_keys"], results["spe4_trace_time_keys"] = [], []
    fit = keras.Model.fit.__wrapped__  # past keras_mgpu's check
    for _ in range(repeats):
        for spe in (1, 4):
            with strategy.scope():
                model = _model(spe)
            results[f"spe{spe}_trace_time_keys"].append(
                _seconds_per_step(model, x, y, [], fit=fit)
            )
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    from _processes import run_workers

    backup = os.path.join(tempfile.mkdtemp(), "backup")
    results = run_workers(
        "bench_multi_worker:worker",
        2,
        timeout=3000,
        args=(args.repeats, args.steps, backup),
        env={"PYTHONPATH": os.pathsep.join([HERE, ROOT])},
    )
    chief = results[0]
    medians = {case: statistics.median(v) for case, v in chief.items()}
    for case, value in medians.items():
        print(
            json.dumps(
                {
                    "case": case,
                    "seconds_per_step": round(value, 5),
                    "rounds": len(chief[case]),
                    "workers": 2,
                }
            )
        )
    ratios = {c: round(medians[c] / medians["plain"], 3) for c in CASES}
    ratios["spe4_vs_spe1"] = round(
        medians["spe4_trace_time_keys"] / medians["spe1_trace_time_keys"], 3
    )
    print(json.dumps({"ratios": ratios}))


if __name__ == "__main__":
    main()

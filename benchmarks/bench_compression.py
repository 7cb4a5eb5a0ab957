"""Benchmark: gradient compression, bytes and time per update, side by side.

For the demo CNN (`keras_mgpu.demo.build_model`, 47.5k parameters) and a
~21M-parameter MLP (2048 -> 5 x Dense 2048 -> 10), each compression method
of `GradientAccumulationOptimizer` (accumulation_steps=1):
`float32` (none), `float16`, `bfloat16`, `power_sgd` (rank 2):

- bytes per update, measured by `CrossDeviceByteCounter` (what one replica
  hands to the collectives: gradients, and side information such as the
  float16 scaling bounds or the float32 "finite?" flag), under
  `MirroredStrategy` x2 (2 logical CPUs, one process) and between 2
  `MultiWorkerMirroredStrategy` worker processes on 127.0.0.1;
- time per update between the 2 workers (Keras 3 `model.fit` after
  `keras_mgpu.distribute.enable_multi_worker_fit()`), every method timed in
  turn in each round; the ratios are medians of the per-round ratios to
  float32.

Prints one JSON line per (pass, model, method), then one line of ratios.

Usage: python benchmarks/bench_compression.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # tests/_processes.py

METHODS = ("float32", "float16", "bfloat16", "power_sgd")
MLP_WIDTH = 2048
MLP_LAYERS = 5


def _method(name: str):
    from keras_mgpu.compression import PowerSGD

    return {
        "float32": None,
        "float16": "float16",
        "bfloat16": "bfloat16",
        "power_sgd": PowerSGD(rank=2, start_after_updates=0),
    }[name]


def _model(name: str):
    import keras

    from keras_mgpu.demo import build_model

    keras.utils.set_random_seed(0)
    if name == "demo_cnn":
        return build_model(recompute=False)
    layers = [keras.Input((MLP_WIDTH,))]
    layers += [
        keras.layers.Dense(MLP_WIDTH, activation="relu")
        for _ in range(MLP_LAYERS)
    ]
    return keras.Sequential([*layers, keras.layers.Dense(10)])


def _data(name: str, samples: int):
    import numpy as np

    rng = np.random.default_rng(0)
    shape = (8, 8, 1) if name == "demo_cnn" else (MLP_WIDTH,)
    x = rng.uniform(size=(samples, *shape)).astype("float32")
    y = rng.integers(0, 10, size=samples).astype("int32")
    return x, y


def _compiled(name: str, method: str, strategy):
    import keras

    from keras_mgpu import GradientAccumulationOptimizer

    with strategy.scope():
        model = _model(name)
        model.compile(
            optimizer=GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.01, momentum=0.9),
                1,
                compression=_method(method),
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def _bytes_row(records: list, updates: int, method: str) -> dict:
    """Bytes per update: the gradients; the rest (scalars: our float32
    "finite?" flag and, in multi-worker `fit`, Keras's reduction of the
    step's logs; float16's float32 scaling bounds); and the distributed
    dataset's own int64 flags (multi-worker input)."""
    gradients = other = dataset = 0
    for r in records:
        if r["dtype"].startswith("int"):
            dataset += r["bytes"]
        elif not r["shape"] or (
            method == "float16" and r["dtype"] == "float32"
        ):
            other += r["bytes"]
        else:
            gradients += r["bytes"]
    return {
        "gradient_bytes": gradients // updates,
        "other_bytes": other // updates,
        "dataset_bytes": dataset // updates,
    }


def _resetting(counter):
    """Keras callback: counts start with the training loop, after the shape
    probe Keras reduces once per `fit` call (its first batch)."""
    import keras

    class Reset(keras.callbacks.Callback):
        def on_train_begin(self, logs=None):
            counter.reset()

    return Reset()


# ----------------------------------------------------------------------
# MirroredStrategy x2 in one process: bytes only
# ----------------------------------------------------------------------
def mirrored_bytes(task_index: int, models: list, updates: int) -> list:
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    from keras_mgpu.compression import CrossDeviceByteCounter

    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    counter = CrossDeviceByteCounter(strategy)
    rows = []
    for name in models:
        x, y = _data(name, 16 * (updates + 1))
        for method in METHODS:
            model = _compiled(name, method, strategy)
            model.fit(x[:16], y[:16], batch_size=16, verbose=0)
            model.fit(
                x[16:],
                y[16:],
                batch_size=16,
                shuffle=False,
                verbose=0,
                callbacks=[_resetting(counter)],
            )
            rows.append(
                {
                    "pass": "mirrored_x2",
                    "model": name,
                    "method": method,
                    "parameters": model.count_params(),
                    **_bytes_row(counter.records(), updates, method),
                }
            )
            del model
    return rows


# ----------------------------------------------------------------------
# 2 worker processes: bytes and time per update
# ----------------------------------------------------------------------
class _StepTimer:
    """Keras callback: seconds from the start of the second step to the
    end of the epoch (the first step of each fit pays iterator set-up)."""

    def __new__(cls):
        import keras

        class Timer(keras.callbacks.Callback):
            def on_train_batch_begin(self, batch, logs=None):
                if batch == 1:
                    self.start = time.perf_counter()

            def on_epoch_end(self, epoch, logs=None):
                self.seconds = time.perf_counter() - self.start

        return Timer()


def worker(task_index: int, config: dict) -> dict:
    import tensorflow as tf

    import keras_mgpu
    from keras_mgpu.compression import CrossDeviceByteCounter

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    keras_mgpu.distribute.enable_multi_worker_fit()
    counter = CrossDeviceByteCounter(strategy)
    updates, rounds = config["updates"], config["rounds"]
    result: dict = {}
    for name in config["models"]:
        batch = config["batch"][name]
        x, y = _data(name, batch * (updates + 1))
        models = {}
        for method in METHODS:  # build and trace every method first
            models[method] = _compiled(name, method, strategy)
            models[method].fit(
                x[:batch], y[:batch], batch_size=batch, verbose=0
            )
        times = {m: [] for m in METHODS}
        records = {}
        for round_index in range(rounds):
            shift = round_index % len(METHODS)
            for method in METHODS[shift:] + METHODS[:shift]:
                timer = _StepTimer()
                models[method].fit(
                    x,
                    y,
                    batch_size=batch,
                    shuffle=False,
                    verbose=0,
                    callbacks=[_resetting(counter), timer],
                )
                times[method].append(timer.seconds / updates)
                records[method] = counter.records()
        result[name] = {
            method: {
                "parameters": models[method].count_params(),
                "update_s": times[method],
                **_bytes_row(records[method], updates + 1, method),
            }
            for method in METHODS
        }
        del models
    counter.remove()
    return result


def _ratios(times: dict) -> dict:
    """Median over rounds of each method's time / float32's."""
    return {
        method: round(
            statistics.median(
                t / f for t, f in zip(times[method], times["float32"])
            ),
            3,
        )
        for method in METHODS
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--updates", type=int, default=4)
    parser.add_argument("--skip-mirrored", action="store_true")
    args = parser.parse_args()
    from _processes import run_in_process, run_workers

    models = ["demo_cnn", "mlp_21m"]
    if args.quick:
        args.rounds, args.updates = 2, 2
    ratios_line: dict = {"benchmark": "compression_ratios"}
    if not args.skip_mirrored:
        rows = run_in_process(
            "benchmarks.bench_compression:mirrored_bytes",
            timeout=1800,
            args=(models, 2),
        )
        for row in rows:
            print(json.dumps({"benchmark": "compression_bytes", **row}))
    config = {
        "models": models,
        "updates": args.updates,
        "rounds": args.rounds,
        "batch": {"demo_cnn": 64, "mlp_21m": 64},
    }
    results = run_workers(
        "benchmarks.bench_compression:worker",
        num_workers=2,
        timeout=3600,
        args=(config,),
    )
    for name in models:
        chief = results[0][name]
        plain = chief["float32"]
        for method in METHODS:
            row = chief[method]
            total = row["gradient_bytes"] + row["other_bytes"]
            plain_total = plain["gradient_bytes"] + plain["other_bytes"]
            print(
                json.dumps(
                    {
                        "benchmark": "compression_multi_worker",
                        "model": name,
                        "method": method,
                        "parameters": row["parameters"],
                        "gradient_bytes": row["gradient_bytes"],
                        "other_bytes": row["other_bytes"],
                        "dataset_bytes": row["dataset_bytes"],
                        "bytes_ratio_vs_float32": round(plain_total / total, 2),
                        "update_s_median": round(
                            statistics.median(row["update_s"]), 4
                        ),
                        "update_s_per_round": [
                            round(t, 4) for t in row["update_s"]
                        ],
                    }
                ),
                flush=True,
            )
        ratios_line[f"{name}_time_vs_float32"] = _ratios(
            {m: chief[m]["update_s"] for m in METHODS}
        )
    print(json.dumps(ratios_line))


if __name__ == "__main__":
    main()

"""Benchmark: GradientAccumulationOptimizer against the computations it
replaces, measured side by side in one process.

Prints one JSON line per case, then one line of ratios:
- `plain_micro`: plain optimizer at the micro-batch (no accumulation);
- `wrapper`: GradientAccumulationOptimizer at the same micro-batch;
- `keras_builtin`: Keras's own `gradient_accumulation_steps` (default
  strategy only: it fails under MirroredStrategy);
- `plain_large`: plain optimizer at the large batch the window replaces;
and, each in a fresh subprocess, the peak host memory (RSS) of training with
accumulation vs. the large batch.

Usage: python benchmarks/bench_accumulation.py [--quick] [--strategy mirrored]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _configure_devices(strategy_name: str):
    import tensorflow as tf

    if strategy_name == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2
        )
        return tf.distribute.MirroredStrategy(
            ["/cpu:0", "/cpu:1"],
            cross_device_ops=tf.distribute.ReductionToOneDevice(),
        )
    return tf.distribute.get_strategy()


def _model(keras, width: int):
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [
            keras.Input((width,)),
            keras.layers.Dense(2 * width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(10),
        ]
    )


def build(case, strategy, keras, width, accumulation):
    """The benchmark's model for `case`, built and compiled in the scope of
    `strategy` (a `tf.distribute` strategy, a `keras.distribution`, or None:
    the default). Shared with bench_accumulation_jax.py."""
    import contextlib

    from keras_mgpu import GradientAccumulationOptimizer

    with strategy.scope() if strategy else contextlib.nullcontext():
        model = _model(keras, width)
        if case == "wrapper":
            optimizer = GradientAccumulationOptimizer(
                keras.optimizers.Adam(1e-4), accumulation
            )
        elif case == "keras_builtin":
            optimizer = keras.optimizers.Adam(
                1e-4, gradient_accumulation_steps=accumulation
            )
        else:
            optimizer = keras.optimizers.Adam(1e-4)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    return model


def _dataset(tf, width, batch, steps):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, width)).astype("float32")
    y = rng.integers(0, 10, size=(batch * steps,))
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).cache()


def throughput(args) -> list[dict]:
    import tensorflow as tf

    strategy = _configure_devices(args.strategy)
    from keras_mgpu._flavour import keras

    k, micro = args.accumulation, args.micro_batch
    cases = {
        "plain_micro": (micro, args.steps),
        "wrapper": (micro, args.steps),
        "plain_large": (micro * k, args.steps // k),
    }
    if args.strategy == "default":
        cases["keras_builtin"] = (micro, args.steps)
    models, data = {}, {}
    for case, (batch, steps) in cases.items():
        models[case] = build(case, strategy, keras, args.width, k)
        data[case] = _dataset(tf, args.width, batch, steps)
        models[case].fit(data[case], verbose=0)  # trace and warm up
    times = {case: [] for case in cases}
    for _ in range(args.repeats):  # interleaved, to share the noise
        for case in cases:
            start = time.perf_counter()
            models[case].fit(data[case], verbose=0)
            times[case].append(time.perf_counter() - start)
    rows = []
    params = models["wrapper"].count_params()
    for case, (batch, steps) in cases.items():
        median = statistics.median(times[case])
        rows.append(
            {
                "benchmark": "accumulation_throughput",
                "case": case,
                "strategy": args.strategy,
                "parameters": params,
                "batch": batch,
                "steps": steps,
                "samples_per_s": round(batch * steps / median, 1),
                "micro_steps_per_s": round(
                    (args.steps if case != "plain_large" else steps * k)
                    / median,
                    2,
                ),
                "median_s": round(median, 4),
            }
        )
    return rows


def peak_memory_child(case: str, args) -> dict:
    import tensorflow as tf

    strategy = _configure_devices(args.strategy)
    from keras_mgpu._flavour import keras

    # Activations dominate only at large batches: use a bigger micro-batch
    # and two updates' worth of data, so the data itself stays small.
    k = args.accumulation
    batch = args.memory_micro_batch * (k if case == "plain_large" else 1)
    steps = 2 * (1 if case == "plain_large" else k)
    model = build(case, strategy, keras, args.width, k)
    dataset = _dataset(tf, args.width, batch, steps)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:  # TensorFlow's allocator peak: tensors only (needs oneDNN on CPU)
        tf.config.experimental.reset_memory_stats("CPU:0")
    except (ValueError, RuntimeError):
        pass
    model.fit(dataset, verbose=0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        tf_peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    except (ValueError, RuntimeError):
        tf_peak = float("nan")
    return {
        "case": case,
        "peak_rss_mb": peak / 1024,
        "before_mb": before / 1024,
        "tf_peak_mb": tf_peak / 2**20,
    }


def peak_memory(args) -> list[dict]:
    rows = []
    for case in ("wrapper", "plain_large"):
        cmd = [sys.executable, __file__, "--child", case, *sys.argv[1:]]
        env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1"}
        out = subprocess.run(
            cmd, capture_output=True, text=True, check=True, env=env
        )
        row = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(
            {
                "benchmark": "accumulation_peak_host_memory",
                "strategy": args.strategy,
                "case": case,
                "batch": args.memory_micro_batch
                * (args.accumulation if case == "plain_large" else 1),
                "peak_rss_mb": round(row["peak_rss_mb"], 1),
                "growth_during_fit_mb": round(
                    row["peak_rss_mb"] - row["before_mb"], 1
                ),
                "tf_allocator_peak_mb": round(row["tf_peak_mb"], 1),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument(
        "--strategy", choices=["default", "mirrored"], default="default"
    )
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--memory-micro-batch", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.width, args.steps, args.repeats = 256, 16, 2
        args.memory_micro_batch = 512
    if args.child:
        print(json.dumps(peak_memory_child(args.child, args)))
        return
    rows = throughput(args)
    for row in rows:
        print(json.dumps(row), flush=True)
    by_case = {r["case"]: r for r in rows}
    ratios = {
        "benchmark": "accumulation_ratios",
        "strategy": args.strategy,
        "wrapper_vs_plain_micro_steps_per_s": round(
            by_case["wrapper"]["micro_steps_per_s"]
            / by_case["plain_micro"]["micro_steps_per_s"],
            3,
        ),
        "wrapper_vs_plain_large_samples_per_s": round(
            by_case["wrapper"]["samples_per_s"]
            / by_case["plain_large"]["samples_per_s"],
            3,
        ),
    }
    if "keras_builtin" in by_case:
        ratios["wrapper_vs_keras_builtin_steps_per_s"] = round(
            by_case["wrapper"]["micro_steps_per_s"]
            / by_case["keras_builtin"]["micro_steps_per_s"],
            3,
        )
    memory = peak_memory(args)
    for row in memory:
        print(json.dumps(row), flush=True)
    mem = {r["case"]: r for r in memory}
    ratios["wrapper_vs_plain_large_peak_rss"] = round(
        mem["wrapper"]["peak_rss_mb"] / mem["plain_large"]["peak_rss_mb"], 3
    )
    ratios["wrapper_vs_plain_large_tf_allocator_peak"] = round(
        mem["wrapper"]["tf_allocator_peak_mb"]
        / mem["plain_large"]["tf_allocator_peak_mb"],
        3,
    )
    print(json.dumps(ratios), flush=True)


if __name__ == "__main__":
    main()

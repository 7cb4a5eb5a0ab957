"""Benchmark: accumulating sparse (Embedding) gradients, side by side.

Prints one JSON line per case, then one line of ratios:
- `plain_micro`: plain Adagrad at the micro-batch (no accumulation);
- `wrapper`: GradientAccumulationOptimizer (looked-up rows scattered into
  the accumulator, the window's touched rows handed over as slices);
- `wrapper_densified`: the same wrapper fed densified gradients, which is
  what keras_mgpu 0.1 did with every `tf.IndexedSlices`;
- `plain_large`: plain Adagrad at the large batch the window replaces.

The model is an embedding table (`--rows` x `--dim`) looked up `--ids`
times per sample, then a small dense head: the sparse gradient touches a
few thousand rows of a large table.

Usage: python benchmarks/bench_sparse_accumulation.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _build(case: str, args):
    import tensorflow as tf

    from keras_mgpu import GradientAccumulationOptimizer
    from keras_mgpu._flavour import keras

    class Densified(GradientAccumulationOptimizer):
        def apply(self, grads, trainable_variables=None):
            grads = [
                tf.convert_to_tensor(g)
                if isinstance(g, tf.IndexedSlices)
                else g
                for g in grads
            ]
            return super().apply(grads, trainable_variables)

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((args.ids,), dtype="int32"),
            keras.layers.Embedding(args.rows, args.dim),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )
    inner = keras.optimizers.Adagrad(0.05)
    if case == "wrapper":
        optimizer = GradientAccumulationOptimizer(inner, args.accumulation)
    elif case == "wrapper_densified":
        optimizer = Densified(inner, args.accumulation)
    else:
        optimizer = inner
    model.compile(optimizer=optimizer, loss="mse")
    return model


def _dataset(args, batch: int, steps: int):
    import numpy as np
    import tensorflow as tf

    rng = np.random.default_rng(0)
    x = rng.integers(0, args.rows, size=(batch * steps, args.ids))
    y = rng.normal(size=(batch * steps, 1)).astype("float32")
    return tf.data.Dataset.from_tensor_slices((x.astype("int32"), y)).batch(
        batch
    )


def throughput(args) -> list[dict]:
    k, micro = args.accumulation, args.micro_batch
    cases = {
        "plain_micro": (micro, args.steps),
        "wrapper": (micro, args.steps),
        "wrapper_densified": (micro, args.steps),
        "plain_large": (micro * k, args.steps // k),
    }
    models, data = {}, {}
    for case, (batch, steps) in cases.items():
        models[case] = _build(case, args)
        data[case] = _dataset(args, batch, steps).cache()
        models[case].fit(data[case], verbose=0)  # trace and warm up
    times = {case: [] for case in cases}
    for _ in range(args.repeats):  # interleaved, to share the noise
        for case in cases:
            start = time.perf_counter()
            models[case].fit(data[case], verbose=0)
            times[case].append(time.perf_counter() - start)
    rows = []
    for case, (batch, steps) in cases.items():
        median = statistics.median(times[case])
        micro_steps = args.steps if case != "plain_large" else steps * k
        rows.append(
            {
                "benchmark": "sparse_accumulation_throughput",
                "case": case,
                "table": [args.rows, args.dim],
                "batch": batch,
                "steps": steps,
                "micro_steps_per_s": round(micro_steps / median, 2),
                "median_s": round(median, 4),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ids", type=int, default=8)
    parser.add_argument("--micro-batch", type=int, default=256)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.steps, args.repeats = 20_000, 16, 2
    rows = throughput(args)
    for row in rows:
        print(json.dumps(row))
    rate = {row["case"]: row["micro_steps_per_s"] for row in rows}
    print(
        json.dumps(
            {
                "benchmark": "sparse_accumulation_ratios",
                "wrapper_vs_densified": round(
                    rate["wrapper"] / rate["wrapper_densified"], 2
                ),
                "wrapper_vs_plain_micro": round(
                    rate["wrapper"] / rate["plain_micro"], 2
                ),
            }
        )
    )


if __name__ == "__main__":
    main()

"""Accuracy check: gradient compression on the demo (digits, 10 epochs).

Trains `keras_mgpu.demo.build_model` on scikit-learn's 8x8 digits under
`MirroredStrategy` across 2 logical CPU devices (the demo's setting, default
cross-device ops), with `GradientAccumulationOptimizer(Adam, 2,
compression=...)` for each method: float32 (none), float16, bfloat16,
PowerSGD rank 2, from the same initial weights and the same shuffling for a
given seed. Prints one JSON line per (seed, method):

- `test_accuracy` after the last epoch, on the held-out 20%;
- the first update's weights against the float32 all-reduce:
  `first_update_max_abs_diff` and, relative to how far float32 moved the
  weights, `first_update_relative_diff`;

then one summary line: mean accuracy per method and its difference from
float32 (the target: within 1 point).

Usage: python benchmarks/check_compression_accuracy.py [--epochs 10]
       [--seeds 0 1 2] [--methods float32 power_sgd]
       [--power-sgd-rank 2] [--power-sgd-start 0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

METHODS = ("float32", "float16", "bfloat16", "power_sgd")
ACCUMULATION = 2
PER_REPLICA_BATCH = 32


POWER_SGD = {"rank": 2, "start_after_updates": 0}


def _method(name: str):
    from keras_mgpu.compression import PowerSGD

    return {
        "float32": None,
        "float16": "float16",
        "bfloat16": "bfloat16",
        "power_sgd": PowerSGD(**POWER_SGD),
    }[name]


def _first_update_recorder():
    import keras
    import numpy as np

    class Recorder(keras.callbacks.Callback):
        """The weights before training and after the first update (the
        end of micro-step ACCUMULATION of epoch 0)."""

        def on_train_begin(self, logs=None):
            self.initial = [np.array(w) for w in self.model.get_weights()]

        def on_train_batch_end(self, batch, logs=None):
            if batch == ACCUMULATION - 1 and not hasattr(self, "first"):
                self.first = [np.array(w) for w in self.model.get_weights()]

    return Recorder()


def _train(strategy, data, method: str, seed: int, epochs: int) -> dict:
    import keras

    from keras_mgpu import GradientAccumulationOptimizer
    from keras_mgpu.demo import build_model

    x_train, y_train, x_test, y_test = data
    global_batch = PER_REPLICA_BATCH * strategy.num_replicas_in_sync
    with strategy.scope():
        keras.utils.set_random_seed(seed)
        model = build_model(recompute=False)
        # The demo's rate (1e-3 at batch 32), scaled linearly to the
        # batch of one update.
        rate = 1e-3 * global_batch * ACCUMULATION / 32
        model.compile(
            optimizer=GradientAccumulationOptimizer(
                keras.optimizers.Adam(rate),
                ACCUMULATION,
                compression=_method(method),
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    recorder = _first_update_recorder()
    keras.utils.set_random_seed(seed)  # the same shuffling for every method
    model.fit(
        x_train,
        y_train,
        batch_size=global_batch,
        epochs=epochs,
        verbose=0,
        callbacks=[recorder],
    )
    _, accuracy = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    return {
        "accuracy": float(accuracy),
        "initial": recorder.initial,
        "first": recorder.first,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument(
        "--methods", nargs="+", default=list(METHODS), choices=METHODS
    )
    parser.add_argument("--power-sgd-rank", type=int, default=2)
    parser.add_argument(
        "--power-sgd-start",
        type=int,
        default=0,
        help="PowerSGD's start_after_updates (the demo: 11 updates/epoch)",
    )
    args = parser.parse_args()
    POWER_SGD.update(
        rank=args.power_sgd_rank, start_after_updates=args.power_sgd_start
    )
    methods = ["float32"] + [m for m in args.methods if m != "float32"]

    from keras_mgpu.demo import configure_devices, load_digits_split

    configure_devices(2, use_gpus=False)
    import numpy as np
    import tensorflow as tf

    strategy = tf.distribute.MirroredStrategy()
    data = load_digits_split(seed=0)
    accuracies: dict = {m: [] for m in methods}
    for seed in args.seeds:
        runs = {
            m: _train(strategy, data, m, seed, args.epochs) for m in methods
        }
        plain = runs["float32"]
        moved = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(plain["first"], plain["initial"])
        )
        for method, run in runs.items():
            difference = max(
                float(np.max(np.abs(a - b)))
                for a, b in zip(run["first"], plain["first"])
            )
            accuracies[method].append(run["accuracy"])
            print(
                json.dumps(
                    {
                        "benchmark": "compression_accuracy",
                        "seed": seed,
                        "method": method,
                        "epochs": args.epochs,
                        "test_accuracy": round(run["accuracy"], 4),
                        "accuracy_minus_float32_points": round(
                            100 * (run["accuracy"] - plain["accuracy"]), 2
                        ),
                        "first_update_max_abs_diff": difference,
                        "first_update_relative_diff": difference / moved,
                    }
                ),
                flush=True,
            )
    mean = {m: statistics.mean(a) for m, a in accuracies.items()}
    print(
        json.dumps(
            {
                "benchmark": "compression_accuracy_summary",
                "seeds": args.seeds,
                "power_sgd": POWER_SGD,
                "mean_test_accuracy": {m: round(v, 4) for m, v in mean.items()},
                "mean_minus_float32_points": {
                    m: round(100 * (v - mean["float32"]), 2)
                    for m, v in mean.items()
                },
                "within_1_point": all(
                    abs(v - mean["float32"]) <= 0.01 for v in mean.values()
                ),
            }
        )
    )


if __name__ == "__main__":
    main()

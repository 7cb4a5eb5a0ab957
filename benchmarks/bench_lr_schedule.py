"""Step-time overhead of the warmup schedule and the LR callbacks.

Cases, side by side in one process on the same model and data: constant
learning rate (reference), `Warmup(CosineDecay)` compiled in the optimizer,
`LearningRateWarmup`, `LearningRateScaler`, and both callbacks together.
Prints one JSON line per case with the median step time and the ratio to
the constant learning rate (target: <= 1.01).

    python benchmarks/bench_lr_schedule.py [--quick] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from keras_mgpu._flavour import FLAVOUR, keras
from keras_mgpu.callbacks import LearningRateScaler, LearningRateWarmup
from keras_mgpu.schedules import Warmup


class _StepTimer(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.times = []

    def on_train_batch_begin(self, batch, logs=None):
        self._start = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        self.times.append(time.perf_counter() - self._start)


def _case(name, steps, batch, width, repeats):
    x = np.random.default_rng(0).normal(size=(steps * batch, 32))
    x = x.astype("float32")
    y = x[:, :1].copy()
    lr = 0.05
    if name == "warmup_schedule":
        lr = Warmup(keras.optimizers.schedules.CosineDecay(0.05, 10_000), 500)
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(width, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9), loss="mse")
    callbacks = []
    if name in ("warmup_callback", "both_callbacks"):
        callbacks.append(LearningRateWarmup(warmup_steps=500))
    if name in ("scaler_callback", "both_callbacks"):
        callbacks.insert(
            0,
            LearningRateScaler(
                base_batch_size=batch, batch_size=2 * batch, verbose=0
            ),
        )
    timer = _StepTimer()
    # First fit traces; later fits reuse the trace (also with our callbacks).
    model.fit(x, y, batch_size=batch, epochs=1, verbose=0, callbacks=callbacks)
    medians = []
    for _ in range(repeats):
        timer.times.clear()
        model.fit(
            x,
            y,
            batch_size=batch,
            epochs=1,
            verbose=0,
            shuffle=False,
            callbacks=[*callbacks, timer],
        )
        medians.append(statistics.median(timer.times[1:]))
    return statistics.median(medians)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    args = parser.parse_args()
    steps = args.steps or (100 if args.quick else 300)
    repeats = 3 if args.quick else 5
    names = [
        "constant",
        "warmup_schedule",
        "warmup_callback",
        "scaler_callback",
        "both_callbacks",
    ]
    # Interleave the cases over rounds so drift in machine load is shared.
    results = {name: [] for name in names}
    for _ in range(2):
        for name in names:
            results[name].append(
                _case(name, steps, args.batch, args.width, repeats)
            )
    reference = min(results["constant"])
    for name in names:
        step = min(results[name])
        print(
            json.dumps(
                {
                    "benchmark": "lr_schedule",
                    "case": name,
                    "flavour": FLAVOUR,
                    "steps": steps,
                    "batch": args.batch,
                    "width": args.width,
                    "median_step_ms": round(step * 1e3, 4),
                    "ratio_vs_constant": round(step / reference, 4),
                }
            )
        )


if __name__ == "__main__":
    main()

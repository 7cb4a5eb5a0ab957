"""Fit time with each of our callbacks (default arguments) against plain
Keras `fit`, on a small MLP, on the backend KERAS_BACKEND names.

One process, one compiled model. Each repeat runs every case once, back to
back, in an order that rotates each repeat, so machine noise hits all
alike; each case's callback is created afresh for each `fit` (as in a loop
or a notebook: the LR callbacks must not recompile). Prints one JSON line
per case:

- `step_ms`: median time per step inside the epoch (first batch begin to
  epoch end, all steps done; the epoch end's own work left out);
- `step_ratio`: median over repeats of the case's step time over plain's in
  the same repeat; budget 1.01 (issue 36);
- `fit_ratio`: the same for the whole `fit` call (per-`fit` and per-epoch
  work included: a backup written at the epoch end, a sampler started).

    KERAS_BACKEND=jax python benchmarks/bench_callbacks_overhead.py
    KERAS_BACKEND=tensorflow python benchmarks/bench_callbacks_overhead.py
    ... --quick   # fewer steps and repeats

On a shared 2-core machine the ratios carry a few percent of noise: read
them with the spread (`step_ratio_min`, `step_ratio_max`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

BUDGET = 1.01
# Callbacks that need more than a Keras 3 model: skipped, with the reason.
SKIPPED = {"PruningStepSync": "needs TFMOT pruning wrappers (tf_keras)"}


def _arguments(name: str, batch: int, folder: str) -> dict:
    """Minimal required arguments; the rest are the defaults."""
    return {
        "BackupAndRestore": {"backup_dir": os.path.join(folder, "backup")},
        "LearningRateScaler": {"base_batch_size": batch, "batch_size": batch},
        "LearningRateWarmup": {"warmup_steps": 100},
    }.get(name, {})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 60, 3

    import keras
    import numpy as np

    import keras_mgpu.callbacks as ours

    warnings.simplefilter("ignore")  # monitors' one-off notices
    names = [n for n in sorted(ours.__all__) if n not in SKIPPED]
    cases = ["plain", *names]

    model = keras.Sequential(
        [
            keras.Input((args.width,)),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * args.batch, args.width))
    x = x.astype("float32")
    y = x[:, :1].copy()

    class Clock(keras.callbacks.Callback):
        """First batch begin to epoch end (begin hooks only: it never
        changes Keras's dispatch)."""

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 0:
                self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            self.seconds = time.perf_counter() - self.start

    folder = tempfile.mkdtemp(prefix="keras_mgpu_bench_cb_")

    def fit(case: str) -> tuple[float, float]:
        clock = Clock()
        callbacks = [clock]  # first: its epoch end precedes the others'
        if case != "plain":
            cls = getattr(ours, case)
            callbacks.append(cls(**_arguments(case, args.batch, folder)))
        start = time.perf_counter()
        model.fit(
            x,
            y,
            batch_size=args.batch,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
        return clock.seconds / args.steps, time.perf_counter() - start

    for case in cases:  # warm-up: compile every variant once
        fit(case)
    steps = {c: [] for c in cases}
    fits = {c: [] for c in cases}
    for repeat in range(args.repeats):
        shift = repeat % len(cases)
        for case in cases[shift:] + cases[:shift]:
            step, whole = fit(case)
            steps[case].append(step)
            fits[case].append(whole)

    backend = keras.backend.backend()
    for case in cases:
        step_ratios = [
            s / p for s, p in zip(steps[case], steps["plain"], strict=True)
        ]
        fit_ratios = [
            f / p for f, p in zip(fits[case], fits["plain"], strict=True)
        ]
        ratio = statistics.median(step_ratios)
        print(
            json.dumps(
                {
                    "bench": "callbacks_overhead",
                    "backend": backend,
                    "case": case,
                    "step_ms": round(1000 * statistics.median(steps[case]), 4),
                    "step_ratio": round(ratio, 4),
                    "step_ratio_min": round(min(step_ratios), 4),
                    "step_ratio_max": round(max(step_ratios), 4),
                    "fit_ratio": round(statistics.median(fit_ratios), 4),
                    "within_budget": ratio <= BUDGET,
                    "budget": BUDGET,
                    "steps": args.steps,
                    "repeats": args.repeats,
                    "batch": args.batch,
                    "width": args.width,
                }
            ),
            flush=True,
        )
    for name, reason in SKIPPED.items():
        print(
            json.dumps(
                {"bench": "callbacks_overhead", "case": name, "skipped": reason}
            )
        )


if __name__ == "__main__":
    main()

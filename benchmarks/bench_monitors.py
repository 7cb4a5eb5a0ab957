"""Steps per second with MemoryMonitor + GPULoadMonitor on vs. off.

Same model, same data, one process; the two cases are interleaved repeat by
repeat (off, on, off, on, ...) so machine noise hits both alike. Prints one
JSON line per case (median steps/s over the repeats) and the on/off ratio
(target >= 0.99).

    python benchmarks/bench_monitors.py            # ~1 min on 2 CPU cores
    python benchmarks/bench_monitors.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 60, 3

    import numpy as np

    from keras_mgpu._flavour import FLAVOUR, keras, tf
    from keras_mgpu.callbacks import GPULoadMonitor, MemoryMonitor

    warnings.simplefilter("ignore")  # the CPU fallback warns once
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * args.batch, 64)).astype("float32")
    y = rng.normal(size=(args.steps * args.batch, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(args.width, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(1e-3), loss="mse")
    model.fit(x, y, batch_size=args.batch, epochs=1, verbose=0)  # trace

    def run(monitors: bool) -> float:
        callbacks = (
            [MemoryMonitor(), GPULoadMonitor(interval=args.interval)]
            if monitors
            else []
        )
        start = time.perf_counter()
        model.fit(
            x,
            y,
            batch_size=args.batch,
            epochs=args.epochs,
            verbose=0,
            callbacks=callbacks,
        )
        return args.steps * args.epochs / (time.perf_counter() - start)

    rates = {"off": [], "on": []}
    for _ in range(args.repeats):
        for case in ("off", "on"):
            rates[case].append(run(case == "on"))
    medians = {case: statistics.median(r) for case, r in rates.items()}
    device = "gpu" if tf.config.list_physical_devices("GPU") else "cpu"
    for case in ("off", "on"):
        print(
            json.dumps(
                {
                    "bench": "monitors",
                    "case": f"monitors_{case}",
                    "flavour": FLAVOUR,
                    "device": device,
                    "steps_per_s": round(medians[case], 2),
                    "repeats": [round(r, 2) for r in rates[case]],
                    "steps": args.steps * args.epochs,
                    "interval_s": args.interval,
                    "ratio_on_over_off": round(
                        medians["on"] / medians["off"], 4
                    )
                    if case == "on"
                    else 1.0,
                }
            )
        )


if __name__ == "__main__":
    main()

"""Steps per second with MemoryMonitor + GPULoadMonitor on vs. off.

Same model, same data, one process; the two cases are interleaved repeat by
repeat (off, on, off, on, ...) so machine noise hits both alike. Prints one
JSON line per case (median steps/s over the repeats), the ratio of the
medians and the median of the per-repeat on/off ratios (target >= 0.99).

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
    for repeat in range(args.repeats):
        # Alternate which case goes first, so neither always follows the
        # other's clean-up.
        order = ("off", "on") if repeat % 2 == 0 else ("on", "off")
        for case in order:
            rates[case].append(run(case == "on"))
    medians = {case: statistics.median(r) for case, r in rates.items()}
    # Each repeat's pair ran back to back under the same machine load: the
    # median of the paired ratios is steadier than the ratio of medians.
    paired = statistics.median(
        on / off for on, off in zip(rates["on"], rates["off"])
    )
    device = "gpu" if tf.config.list_physical_devices("GPU") else "cpu"
    costs = hook_costs(model, args.interval, MemoryMonitor, GPULoadMonitor)
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
                    "paired_ratio_median": round(paired, 4)
                    if case == "on"
                    else 1.0,
                }
            )
        )
    print(json.dumps({"bench": "monitors_cost", "flavour": FLAVOUR, **costs}))


def hook_costs(model, interval, memory_cls, gpu_cls) -> dict:
    """What the monitors' hooks cost, timed directly on this thread (the
    end-to-end ratios on a shared machine carry its noise; these do not),
    and one reading of the sampling thread."""
    memory, gpu = memory_cls(), gpu_cls(interval=interval)
    for callback in (memory, gpu):
        callback.set_model(model)
    timings: dict = {"train_begin": [], "epoch_end": [], "train_end": []}
    for _ in range(5):
        start = time.perf_counter()
        memory.on_train_begin({})
        gpu.on_train_begin({})
        timings["train_begin"].append(time.perf_counter() - start)
        logs: dict = {"loss": 1.0}
        start = time.perf_counter()
        memory.on_epoch_end(0, logs)
        gpu.on_epoch_end(0, logs)
        timings["epoch_end"].append(time.perf_counter() - start)
        start = time.perf_counter()
        gpu.on_train_end({})
        memory.on_train_end({})
        timings["train_end"].append(time.perf_counter() - start)
    gpu.on_train_begin({})
    sample = gpu._backend.sample if gpu._backend is not None else None
    reading_s = 0.0
    if sample is not None:
        start = time.perf_counter()
        for _ in range(200):
            sample()
        reading_s = (time.perf_counter() - start) / 200
    mode = gpu.mode
    gpu.on_train_end({})

    def ms(name):
        return round(1000 * statistics.median(timings[name][1:]), 3)

    return {
        "mode": mode,
        "train_begin_ms": ms("train_begin"),
        "epoch_end_ms": ms("epoch_end"),
        "train_end_ms": ms("train_end"),
        "reading_us": round(1e6 * reading_s, 1),
        # Share of one core the sampling thread takes at this interval.
        "sampling_core_pct": round(100 * reading_s / interval, 4),
        "interval_s": interval,
    }


if __name__ == "__main__":
    main()

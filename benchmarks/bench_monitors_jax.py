"""Fit step time with MemoryMonitor / GPULoadMonitor on vs. off, Keras's JAX
backend, under `keras.distribution.DataParallel` over the devices found
(4 CPU devices here, via XLA_FLAGS, unless a GPU is present).

One process, one compiled model; the cases run interleaved repeat by repeat
(off, memory, gpu_load, both; the order rotates each repeat) so machine
noise hits all alike. Prints one JSON line per case: median step time, and
the ratios on/off side by side (of the medians, and the median of the
per-repeat ratios, each repeat's cases having run back to back).

    KERAS_BACKEND=jax python benchmarks/bench_monitors_jax.py   # ~1 min
    KERAS_BACKEND=jax python benchmarks/bench_monitors_jax.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings

os.environ["KERAS_BACKEND"] = "jax"
if "jax" not in sys.modules:
    flag = "--xla_force_host_platform_device_count=4"
    if flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (
            os.environ.get("XLA_FLAGS", "") + " " + flag
        ).strip()

CASES = ("off", "memory", "gpu_load", "both")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    # Small on purpose: per-step overhead is what a monitor could add. (On
    # 2 loaded cores, batch 256 x width 256 over 4 CPU devices twice hung
    # in XLA's CPU all-reduce rendezvous, jax 0.10.2: "Expected 4 threads
    # to join the rendezvous, but only 3 of them arrived".)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--interval", type=float, default=0.1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.repeats = 60, 3

    import jax
    import keras
    import numpy as np

    # The hooks' direct timing is the same on both backends.
    from bench_monitors import hook_costs

    from keras_mgpu.callbacks import GPULoadMonitor, MemoryMonitor

    warnings.simplefilter("ignore")  # the CPU notes and fallback warn once
    platform = jax.default_backend()
    devices = keras.distribution.list_devices(platform)
    distribution = keras.distribution.DataParallel(devices=devices)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.steps * args.batch, 64)).astype("float32")
    y = rng.normal(size=(args.steps * args.batch, 1)).astype("float32")
    with distribution.scope():
        # No keras.utils.set_random_seed: it imports TensorFlow when it is
        # installed (to seed it too), even on the JAX backend.
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

        def callbacks(case: str) -> list:
            memory = [MemoryMonitor()] if case in ("memory", "both") else []
            load = (
                [GPULoadMonitor(interval=args.interval)]
                if case in ("gpu_load", "both")
                else []
            )
            return memory + load

        def step_ms(case: str) -> float:
            start = time.perf_counter()
            model.fit(
                x,
                y,
                batch_size=args.batch,
                epochs=args.epochs,
                verbose=0,
                callbacks=callbacks(case),
            )
            elapsed = time.perf_counter() - start
            return 1000 * elapsed / (args.steps * args.epochs)

        times: dict[str, list[float]] = {case: [] for case in CASES}
        for repeat in range(args.repeats):
            # Rotate the order so no case always follows another's clean-up.
            shift = repeat % len(CASES)
            for case in CASES[shift:] + CASES[:shift]:
                times[case].append(step_ms(case))
        costs = hook_costs(model, args.interval, MemoryMonitor, GPULoadMonitor)
    medians = {case: statistics.median(t) for case, t in times.items()}
    # On a shared machine the fastest repeat is the least disturbed one.
    fastest = {case: min(t) for case, t in times.items()}
    for case in CASES:
        paired = statistics.median(
            on / off for on, off in zip(times[case], times["off"], strict=True)
        )
        print(
            json.dumps(
                {
                    "bench": "monitors_jax",
                    "case": case,
                    "backend": "jax",
                    "platform": platform,
                    "devices": len(devices),
                    "distribution": "DataParallel",
                    "step_ms": round(medians[case], 3),
                    "repeats_ms": [round(t, 3) for t in times[case]],
                    "steps": args.steps * args.epochs,
                    "batch": args.batch,
                    "interval_s": args.interval,
                    # > 1.0: slower with the monitor(s) on.
                    "step_time_ratio_on_over_off": round(
                        medians[case] / medians["off"], 4
                    ),
                    "paired_ratio_median": round(paired, 4),
                    "min_step_ms": round(fastest[case], 3),
                    "min_ratio_on_over_off": round(
                        fastest[case] / fastest["off"], 4
                    ),
                    "gpu_load_mode": costs["mode"],
                    "tensorflow_imported": "tensorflow" in sys.modules,
                }
            )
        )

    print(json.dumps({"bench": "monitors_jax_cost", **costs}))


if __name__ == "__main__":
    main()

"""Benchmark: GradientAccumulationOptimizer against Keras's built-in
`gradient_accumulation_steps` on the JAX backend, side by side in one run.

Prints one JSON line per (distribution, case), then one line of ratios per
distribution:
- `plain_micro`: the plain optimizer at the micro-batch (no accumulation);
- `wrapper`: GradientAccumulationOptimizer at the same micro-batch;
- `keras_builtin`: Keras's own `gradient_accumulation_steps` (it runs the
  whole update every micro-step and keeps or discards it; ours runs it only
  at the update, under `lax.cond`);
- `wrapper_spe`: the wrapper compiled with `steps_per_execution =
  accumulation_steps` (one `train_function` call per window; Keras 3.15's
  JAX trainer still makes one jitted call per micro-step inside it, 3.16
  one `lax.scan`).
`step_ms` is the median time of one micro-step in `fit` (repeats
interleaved so that the cases share the noise);
`wrapper_vs_keras_builtin_step_time` is ours over theirs (goal <= 1.0);
the `min_` ratio compares the fastest repeats (steadier on a shared
machine).

Usage: python benchmarks/bench_accumulation_jax.py [--quick] [--devices 4]
(CPU devices come from XLA_FLAGS, set here before JAX starts.)

Under `DataParallel` the model is narrower (`--dp-width`, 128): on a
2-core machine with 4 CPU devices, width 512 made XLA abort after 40 s in
its in-process all-reduce ("Expected 4 threads to join the rendezvous, but
only 3 of them arrived"), with every optimizer, plain included: a device's
Eigen worker blocked in the collective starves the others. Give the
machine as many cores as devices to measure wider models.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The models and optimizers are bench_accumulation.py's, on either backend.
from bench_accumulation import build  # noqa: E402


def throughput(args, distribution_name: str) -> list[dict]:
    import keras
    import numpy as np

    distribution = None
    width = args.width
    if distribution_name == "data_parallel":
        width = args.dp_width
        distribution = keras.distribution.DataParallel(
            devices=keras.distribution.list_devices("cpu")
        )
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.micro_batch * args.steps, width))
    x = x.astype("float32")
    y = rng.integers(0, 10, size=(args.micro_batch * args.steps,))
    cases = ("plain_micro", "wrapper", "keras_builtin", "wrapper_spe")
    models = {}
    for case in cases:
        kind = "wrapper" if case == "wrapper_spe" else case
        models[case] = build(
            kind, distribution, keras, width, args.accumulation
        )
        if case == "wrapper_spe":
            model = models[case]
            with (
                distribution.scope()
                if distribution
                else (contextlib.nullcontext())
            ):
                model.compile(
                    optimizer=model.optimizer,
                    loss=model.loss,
                    steps_per_execution=args.accumulation,
                )

    def run(case):
        with distribution.scope() if distribution else contextlib.nullcontext():
            models[case].fit(
                x, y, batch_size=args.micro_batch, shuffle=False, verbose=0
            )

    for case in cases:
        run(case)  # compile and warm up
    times = {case: [] for case in cases}
    for _ in range(args.repeats):
        for case in cases:
            start = time.perf_counter()
            run(case)
            times[case].append(time.perf_counter() - start)
    rows = []
    for case in cases:
        median = statistics.median(times[case])
        rows.append(
            {
                "benchmark": "accumulation_jax_step_time",
                "backend": "jax",
                "distribution": distribution_name,
                "devices": (
                    len(keras.distribution.list_devices("cpu"))
                    if distribution
                    else 1
                ),
                "case": case,
                "width": width,
                "parameters": models[case].count_params(),
                "micro_batch": args.micro_batch,
                "accumulation_steps": args.accumulation,
                "micro_steps": args.steps,
                "step_ms": round(1000 * median / args.steps, 3),
                "min_step_ms": round(1000 * min(times[case]) / args.steps, 3),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--dp-width", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=64)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.quick:
        args.width, args.dp_width, args.steps, args.repeats = 128, 64, 16, 2
    os.environ.setdefault("KERAS_BACKEND", "jax")
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        flags += f" --xla_force_host_platform_device_count={args.devices}"
    os.environ["XLA_FLAGS"] = flags.strip()
    import keras

    if keras.backend.backend() != "jax":
        raise SystemExit("Run with KERAS_BACKEND=jax (or unset).")
    for distribution_name in ("none", "data_parallel"):
        rows = throughput(args, distribution_name)
        for row in rows:
            print(json.dumps(row), flush=True)
        by_case = {row["case"]: row for row in rows}
        print(
            json.dumps(
                {
                    "benchmark": "accumulation_jax_ratios",
                    "distribution": distribution_name,
                    "wrapper_vs_keras_builtin_step_time": round(
                        by_case["wrapper"]["step_ms"]
                        / by_case["keras_builtin"]["step_ms"],
                        3,
                    ),
                    "wrapper_vs_keras_builtin_min_step_time": round(
                        by_case["wrapper"]["min_step_ms"]
                        / by_case["keras_builtin"]["min_step_ms"],
                        3,
                    ),
                    "wrapper_vs_plain_micro_step_time": round(
                        by_case["wrapper"]["step_ms"]
                        / by_case["plain_micro"]["step_ms"],
                        3,
                    ),
                    "wrapper_spe_vs_wrapper_step_time": round(
                        by_case["wrapper_spe"]["step_ms"]
                        / by_case["wrapper"]["step_ms"],
                        3,
                    ),
                    "wrapper_spe_vs_wrapper_min_step_time": round(
                        by_case["wrapper_spe"]["min_step_ms"]
                        / by_case["wrapper"]["min_step_ms"],
                        3,
                    ),
                    "keras_builtin_vs_plain_micro_step_time": round(
                        by_case["keras_builtin"]["step_ms"]
                        / by_case["plain_micro"]["step_ms"],
                        3,
                    ),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Benchmark: `plan_memory` on Keras's JAX backend, against plain training.

A Dense-GELU MLP whose activations dominate (wide batch, small weights),
`DataParallel` over the CPU devices JAX sees (4 with `--devices 4`, set
before JAX starts). The budget is a fraction (`--fraction`, default 0.5) of
what plain training needs by the planner's own reading, so that plain does
not fit. One JSON line per case:

- `plan`: the chosen candidate and how many were considered, with the
  planning time;
- `plain` / `planned`: the estimated MiB per device, and the time per
  update measured over `--updates` updates of `fit` after a first epoch
  (compilation) left out;
- `check`: the largest difference between the planned model's weights and
  plain's after the same updates (the plan changes how, not what, is
  computed).

Then one line of ratios. Imports nothing from TensorFlow.

    python benchmarks/bench_memory_plan_jax.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--updates", type=int, default=8)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.width, args.batch, args.updates = 128, 2048, 4
    os.environ.setdefault("KERAS_BACKEND", "jax")
    os.environ.setdefault(
        "XLA_FLAGS", f"--xla_force_host_platform_device_count={args.devices}"
    )
    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    import time

    import jax
    import keras
    import numpy as np

    import keras_mgpu

    rng = np.random.default_rng(0)
    samples = args.batch * args.updates
    x = rng.normal(size=(samples, 64)).astype("float32")
    y = rng.normal(size=(samples, 1)).astype("float32")

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((64,))
        h = inputs
        for i in range(args.depth):
            h = keras.layers.Dense(args.width, activation="gelu", name=f"d{i}")(
                h
            )
        model = keras.Model(inputs, keras.layers.Dense(1, name="head")(h))
        model.compile(keras.optimizers.SGD(0.01), "mse")
        return model

    def timed(model, batch_size):
        model.fit(
            x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False
        )
        start = time.perf_counter()
        model.fit(
            x, y, batch_size=batch_size, epochs=1, verbose=0, shuffle=False
        )
        return 1e3 * (time.perf_counter() - start) / args.updates

    distribution = keras.distribution.DataParallel()
    with distribution.scope():
        plain = build()
        sample = (x[: args.batch], y[: args.batch])
        reading = keras_mgpu.plan_memory(plain, sample, memory_budget_mb=1e9)
        need = next(
            c
            for c in reading.candidates
            if c.accumulation_steps == 1
            and c.policy == "none"
            and not c.shard_state
        ).memory_mb
        budget = args.fraction * need
        planned = build()
        start = time.perf_counter()
        plan = keras_mgpu.plan_memory(planned, sample, memory_budget_mb=budget)
        planning = time.perf_counter() - start
        print(
            json.dumps(
                {
                    "case": "plan",
                    "device": jax.devices()[0].platform,
                    "devices": args.devices,
                    "budget_mb": budget,
                    "chosen": plan.chosen.describe(),
                    "fits": plan.fits,
                    "candidates": len(plan.candidates),
                    "planning_s": planning,
                }
            ),
            flush=True,
        )
        plan.apply(planned)
        plain_ms = timed(plain, args.batch)
        planned_ms = timed(planned, plan.batch_size)
    print(
        json.dumps({"case": "plain", "memory_mb": need, "update_ms": plain_ms})
    )
    print(
        json.dumps(
            {
                "case": "planned",
                "memory_mb": plan.chosen.memory_mb,
                "update_ms": planned_ms,
            }
        )
    )
    difference = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(plain.get_weights(), planned.get_weights())
    )
    print(json.dumps({"case": "check", "max_weight_difference": difference}))
    print(
        json.dumps(
            {
                "ratios_vs_plain": {
                    "memory": plan.chosen.memory_mb / need,
                    "update_time": planned_ms / plain_ms,
                }
            }
        )
    )


if __name__ == "__main__":
    main()

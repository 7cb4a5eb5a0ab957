"""Benchmark: activation memory and step time of RecomputeGrad policies.

A deep stack of residual-free MLP blocks (Dense 4w ReLU, Dense w,
LayerNormalization), trained with `train_on_batch`, for three cases:
no recompute, per-block recompute (`apply_recompute(model, blocks)`) and the
sqrt(n) segment policy (`apply_recompute(model, blocks, policy="sqrt")`).
Each case runs in a subprocess of its own so peak figures do not mix.

Memory: the TensorFlow allocator's peak during the timed steps minus what was
in use before them (weights, optimizer slots), from
`tf.config.experimental.get_memory_info` on "GPU:0" when a GPU is present,
otherwise on "CPU:0" (available while oneDNN is on); plus the process peak RSS
(`ru_maxrss`) for reference. Prints one JSON line per case, then one line of
ratios against the no-recompute case.

    python benchmarks/bench_recompute.py            # 24 blocks, width 256
    python benchmarks/bench_recompute.py --quick    # 16 blocks, width 128
    python benchmarks/bench_recompute.py --blocks 48 --width 512 --batch 512
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CASES = ("none", "per_block", "sqrt")


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_case(args: argparse.Namespace) -> dict:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import resource

    import numpy as np

    sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
    from keras_mgpu._flavour import keras, tf
    from keras_mgpu.layers import apply_recompute

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    keras.utils.set_random_seed(0)
    w = args.width
    blocks = [
        keras.Sequential(
            [
                keras.layers.Dense(4 * w, activation="relu"),
                keras.layers.Dense(w),
                keras.layers.LayerNormalization(),
            ],
            name=f"block_{i}",
        )
        for i in range(args.blocks)
    ]
    model = keras.Sequential(
        [keras.Input((w,)), *blocks, keras.layers.Dense(1)]
    )

    def is_block(layer):
        return layer.name.startswith("block_")

    if args.case == "per_block":
        model = apply_recompute(model, layers=is_block)
    elif args.case == "sqrt":
        model = apply_recompute(model, layers=is_block, policy="sqrt")
    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, w)).astype("float32")
    y = rng.normal(size=(args.batch, 1)).astype("float32")
    rss_before = _current_rss()
    model.train_on_batch(x, y)  # trace and warm up
    model.train_on_batch(x, y)
    try:
        tf.config.experimental.reset_memory_stats(device)
        before = tf.config.experimental.get_memory_info(device)["current"]
    except ValueError:
        # CPU allocator stats are unavailable when oneDNN is off (and cannot
        # be reset): fall back to the process RSS below.
        before = None
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        loss = model.train_on_batch(x, y)
        float(np.asarray(loss).ravel()[0])  # wait for the step
        times.append(time.perf_counter() - start)
    peak = None
    if before is not None:
        peak = tf.config.experimental.get_memory_info(device)["peak"] - before
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "case": args.case,
        "device": device,
        "blocks": args.blocks,
        "width": w,
        "batch": args.batch,
        "wrappers": sum(
            type(layer).__name__ == "RecomputeGrad" for layer in model.layers
        ),
        # Allocator peak of a step above what was resident before it
        # (None where the allocator gives no stats).
        "step_peak_mib": None if peak is None else round(peak / 2**20, 2),
        # Process peak RSS above the RSS after building the model: the
        # activations plus tracing overhead (the CPU measure).
        "rss_growth_mib": round((rss - rss_before) / 2**20, 1),
        "step_time_ms": round(1000 * float(np.median(times)), 2),
        "peak_rss_mib": round(rss / 2**20, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.blocks, args.width, args.batch, args.steps = 16, 128, 1024, 3
    if args.case:  # child process
        print(json.dumps(run_case(args)))
        return
    results = {}
    for case in CASES:
        cmd = [
            sys.executable,
            __file__,
            "--case",
            case,
            "--blocks",
            str(args.blocks),
            "--width",
            str(args.width),
            "--batch",
            str(args.batch),
            "--steps",
            str(args.steps),
        ]
        out = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
        if out.returncode != 0 or not lines:
            print(json.dumps({"case": case, "error": out.stderr[-2000:]}))
            continue
        results[case] = json.loads(lines[-1])
        print(lines[-1], flush=True)
    base = results.get("none")
    for case in ("per_block", "sqrt"):
        if base is None or case not in results:
            continue
        r = results[case]
        key = "step_peak_mib" if base["step_peak_mib"] else "rss_growth_mib"
        mem = r[key] / max(base[key], 1e-9)
        slow = r["step_time_ms"] / max(base["step_time_ms"], 1e-9)
        print(
            json.dumps(
                {
                    "ratio": f"{case}/none",
                    "memory_measure": key,
                    "memory": round(mem, 3),
                    "step_time": round(slow, 3),
                    "peak_rss": round(
                        r["peak_rss_mib"] / base["peak_rss_mib"], 3
                    ),
                    "target_met": bool(mem <= 0.5 and slow <= 1.4)
                    if case == "sqrt"
                    else None,
                }
            )
        )


if __name__ == "__main__":
    main()

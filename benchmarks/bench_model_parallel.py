"""Benchmark: one network split across devices, with and without pipelining.

A deep MLP (Dense-ReLU layers, Adam) in five cases: unplaced on one device
(`single`), placed across every device (`placed`, `apply_placement`), and
placed and pipelined with M = 2, 4, 8 micro-batches per step
(`pipelined_M`).

Devices: every GPU when there are GPUs; otherwise the CPU is split into
`--devices` logical devices (default 4), which share the host's cores, so
on CPU the stages cannot run at the same time: the figures there measure
the cost of placement and pipelining, not a speed-up. A speed-up needs
several GPUs (GPipe: near-linear once M >= 4 x stages).

Step time: the five models live in one process and their steps are
interleaved round by round, so a busy machine slows all alike; the median
step of each case is reported.

Memory, per device: the weights and optimizer state each device holds,
read from where TensorFlow put each variable (`placement_report`); and the
TensorFlow allocator's peak during the measured steps minus what was
resident before, per GPU, or process-wide on CPU (logical CPU devices
share one allocator; statistics need `TF_ENABLE_ONEDNN_OPTS=1`, which the
measuring subprocesses set). Each case is measured alone in a subprocess.

Prints one JSON line per case, then one line of ratios per comparison.

    python benchmarks/bench_model_parallel.py   # 8 x Dense 512, batch 512
    python benchmarks/bench_model_parallel.py --quick  # Dense 256, batch 256
    python benchmarks/bench_model_parallel.py --devices 2 --width 1024
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

from _child import options, run_child

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MICRO_BATCHES = (2, 4, 8)
CASES = ("single", "placed", *(f"pipelined_{m}" for m in MICRO_BATCHES))


def configure_devices(count: int) -> list[str]:
    """Every GPU, else `count` logical CPU devices (before TF starts)."""
    import tensorflow as tf

    if tf.config.list_physical_devices("GPU"):
        return [d.name for d in tf.config.list_logical_devices("GPU")]
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * count
    )
    return [d.name for d in tf.config.list_logical_devices("CPU")]


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_model(case: str, args: argparse.Namespace, devices: list[str]):
    """The MLP for `case`, compiled; same initial weights in every case."""
    import numpy as np

    from keras_mgpu._flavour import keras
    from keras_mgpu.placement import apply_placement

    keras.utils.set_random_seed(0)
    w = args.width
    model = keras.Sequential(
        [keras.Input((w,))]
        + [keras.layers.Dense(w, activation="relu") for _ in range(args.layers)]
        + [keras.layers.Dense(1)]
    )
    if case != "single":
        micro = (
            int(case.split("_")[1]) if case.startswith("pipelined") else None
        )
        model = apply_placement(model, devices, micro_batches=micro)
    model.compile(optimizer="adam", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, w)).astype("float32")
    y = rng.normal(size=(args.batch, 1)).astype("float32")
    return model, x, y


def _step(model, x, y) -> None:
    import numpy as np

    loss = model.train_on_batch(x, y)
    float(np.asarray(loss).ravel()[0])  # wait for the step to finish


def _state_per_device(model) -> dict:
    """MiB of weights + optimizer state on each device (from TensorFlow)."""
    from keras_mgpu.placement import placement_report

    return {
        row["device"].replace("/device:", ""): round(
            (row["param_bytes"] + (row["optimizer_bytes"] or 0)) / 2**20, 2
        )
        for row in placement_report(model, print_fn=None)
    }


def memory_child(args: argparse.Namespace) -> dict:
    """Memory of one case, alone in this process."""
    devices = configure_devices(args.devices)
    from keras_mgpu._flavour import tf

    gpus = [d for d in devices if "GPU" in d]
    measured = [d.split("device:")[-1] for d in gpus] or ["CPU:0"]
    model, x, y = build_model(args.child, args, devices)
    rss_before = _current_rss()
    _step(model, x, y)  # trace, build the optimizer
    _step(model, x, y)
    before = {}
    try:
        for device in measured:
            tf.config.experimental.reset_memory_stats(device)
            before[device] = tf.config.experimental.get_memory_info(device)[
                "current"
            ]
    except ValueError:  # no allocator statistics (oneDNN off on CPU)
        before = {}
    for _ in range(args.memory_steps):
        _step(model, x, y)
    peaks = {
        device: round(
            (tf.config.experimental.get_memory_info(device)["peak"] - start)
            / 2**20,
            1,
        )
        for device, start in before.items()
    }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "state_mib_per_device": _state_per_device(model),
        "step_peak_mib": peaks or None,
        "allocator": "per GPU" if gpus else "process-wide (logical CPUs)",
        "rss_growth_mib": round((rss - rss_before) / 2**20, 1),
    }


def time_cases(args: argparse.Namespace) -> dict:
    """Median step time of each case, steps interleaved across cases."""
    devices = configure_devices(args.devices)
    models = {case: build_model(case, args, devices) for case in CASES}
    for model, x, y in models.values():
        _step(model, x, y)  # trace
        _step(model, x, y)
    times: dict = {case: [] for case in CASES}
    for round_index in range(args.rounds):
        # Rotate the order so no case always follows the same one.
        shift = round_index % len(CASES)
        for case in CASES[shift:] + CASES[:shift]:
            model, x, y = models[case]
            for _ in range(args.steps):
                start = time.perf_counter()
                _step(model, x, y)
                times[case].append(time.perf_counter() - start)
    return {
        "devices": len(devices),
        "kind": "GPU" if "GPU" in devices[0] else "logical CPU",
        **{case: statistics.median(t) for case, t in times.items()},
    }


def _run_memory_child(case: str, args: argparse.Namespace) -> dict:
    names = ("devices", "layers", "width", "batch", "memory_steps")
    return run_child(
        __file__,
        ["--child", case, *options(args, names)],
        env={"TF_ENABLE_ONEDNN_OPTS": "1"},
    )


def _ratios(rows: dict) -> list[dict]:
    def peak(row):
        values = list((row.get("step_peak_mib") or {}).values())
        return max(values) if values else None

    def ratio(a, b):
        return None if a is None or not b else round(a / b, 3)

    single, placed = rows["single"], rows["placed"]
    found = [
        {
            "ratio": "placed/single",
            "step_time": ratio(placed["step_time_ms"], single["step_time_ms"]),
            "max_device_state": ratio(
                placed["max_device_state_mib"], single["max_device_state_mib"]
            ),
            "step_peak": ratio(peak(placed), peak(single)),
        }
    ]
    for m in MICRO_BATCHES:
        row = rows[f"pipelined_{m}"]
        found.append(
            {
                "ratio": f"pipelined_{m}/placed",
                "step_time": ratio(row["step_time_ms"], placed["step_time_ms"]),
                "step_peak": ratio(peak(row), peak(placed)),
            }
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=4, help="CPU only")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=3, help="per round")
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.width, args.batch, args.rounds, args.steps = 256, 256, 3, 2
    if args.child:
        print(json.dumps(memory_child(args)))
        return
    memory = {case: _run_memory_child(case, args) for case in CASES}
    timing = time_cases(args)
    rows = {}
    for case in CASES:
        state = memory[case].get("state_mib_per_device") or {}
        rows[case] = {
            "case": case,
            "devices": 1 if case == "single" else timing["devices"],
            "device_kind": timing["kind"],
            "micro_batches": int(case.split("_")[1])
            if case.startswith("pipelined")
            else 1,
            "layers": args.layers,
            "width": args.width,
            "batch": args.batch,
            "step_time_ms": round(1000 * timing[case], 2),
            "max_device_state_mib": max(state.values()) if state else None,
            **memory[case],
        }
        print(json.dumps(rows[case]), flush=True)
    if all("error" not in row for row in rows.values()):
        for line in _ratios(rows):
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()

"""Benchmark: activation memory and step time of RecomputeGrad policies.

A deep stack of MLP blocks (Dense 4w ReLU, Dense w, LayerNormalization; with
`--deep`, `--depth` Dense w ReLU layers per block), trained with
`train_on_batch`, in five cases: no recompute, per-block recompute
(`apply_recompute(model, blocks, in_place=False)`), the same in place
(`apply_recompute(model, blocks, in_place=True)`), the sqrt(n) segment policy
(`apply_recompute(model, blocks, policy="sqrt", in_place=False)`) and, side by
side, each block called through TensorFlow's own `tf.recompute_grad`.

Step time: the five models live in one process. Each step of a recompute
case is paired with a plain step run right before or after it (which one
goes first alternates: ABAB..., then BABA...), for `--steps` pairs per case
per round, the cases in an order rotated from round to round. A case's
time ratio is the median of its pairs' ratios: load that changes between
pairs (the machine is shared) cancels. Raw step times and pair ratios are
printed too.

Memory ("extra memory"): each case runs alone in a subprocess so peaks do
not mix, `--memory-repeats` times, the cases alternated (none, per_block,
..., none, per_block, ...). The figure is the TensorFlow allocator's peak
during the measured steps minus what was resident just before them (the
weights and optimizer slots, which recompute cannot change), from
`tf.config.experimental.get_memory_info` on "GPU:0" when a GPU is present,
otherwise on "CPU:0": activations kept for backprop, gradients and
transient buffers, i.e. the memory a step adds on top of the model. The
ratio is the median of a case over the median of plain. TensorFlow keeps
CPU allocator statistics only with oneDNN on, so the memory subprocesses
run with `TF_ENABLE_ONEDNN_OPTS=1`. The process's peak RSS growth is
reported beside it (coarse on CPU: freed memory is not always returned to
the system).

Graph size (deterministic, a regression signal independent of load): the
ops of the traced train function as built ("graph_ops") and as it runs,
after Grappler ("optimized_ops", with its MatMul count "matmuls"; oneDNN
may fuse MatMul with BiasAdd and ReLU, all counted). One extra forward per
recomputed block adds exactly the block's MatMuls.

With `--deep` (blocks as wide as their insides) per-block recompute has an
activation floor. Plain training holds `blocks * depth + 1` activations
when the backward pass starts (the input and every layer's output);
per-block recompute holds the input and the outputs of the first
`blocks - 1` blocks, plus the `depth` activations of the last block while
it is recomputed: `blocks + depth`, (8 + 4) / 33 = 0.36 for 8 blocks of 4,
before gradients and transient buffers, which raise the ratio. The ratio
line reports each case's floor ("activation_floor") and "bound_at_peak"
(plain's peak less the activations the case does not keep, over plain's
peak: the peak if it held plain's buffers; measured recomputed peaks hold
one or two weight-sized buffers more). For 8 blocks of 4 no per-block
ratio can reach 0.35 (12/33 > 0.35 even with no transients);
`policy="min_memory"` keeps 10 on the blocks ("min_memory") and 9 on the
same layers unnested ("min_memory_layers": segments of 8, 7, 6, 5, 4, 2).

Prints one JSON line per case (step time, extra memory and graph size side
by side), then one line of ratios per case against no recompute, with the
issues' targets (sqrt policy: memory <= 0.5, step time <= 1.4; per block on
the deep MLP: memory <= 0.35, step time <= 1.40).

    python benchmarks/bench_recompute.py            # 24 blocks, width 256
    python benchmarks/bench_recompute.py --quick    # 12 blocks, width 128
    python benchmarks/bench_recompute.py --blocks 48 --width 512 --batch 512
    python benchmarks/bench_recompute.py --deep     # 8 blocks of 4 Dense 1536
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

CASES = (
    "none",
    "per_block",
    "in_place",
    "sqrt",
    "min_memory",
    "min_memory_layers",
    "tf_recompute_grad",
)


def _current_rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def build_model(case: str, args: argparse.Namespace):
    """The stack for `case`, compiled; same initial weights for every case."""
    from keras_mgpu._flavour import keras, tf
    from keras_mgpu.layers import apply_recompute

    class TFRecomputeGrad(keras.layers.Layer):
        """A block called through `tf.recompute_grad` (the reference)."""

        def __init__(self, block, **kwargs):
            super().__init__(name=f"tf_recompute_{block.name}", **kwargs)
            self.block = block

        def call(self, inputs):
            return tf.recompute_grad(self.block)(inputs)

        def compute_output_shape(self, input_shape):
            return self.block.compute_output_shape(input_shape)

    keras.utils.set_random_seed(0)
    w = args.width
    if args.depth:
        layers = [
            [
                keras.layers.Dense(w, activation="relu")
                for _ in range(args.depth)
            ]
            for _ in range(args.blocks)
        ]
    else:
        layers = [
            [
                keras.layers.Dense(4 * w, activation="relu"),
                keras.layers.Dense(w),
                keras.layers.LayerNormalization(),
            ]
            for _ in range(args.blocks)
        ]
    if case == "min_memory_layers":  # the same layers, not in blocks
        flat = [layer for block in layers for layer in block]
        model = keras.Sequential(
            [keras.Input((w,)), *flat, keras.layers.Dense(1)]
        )
        apply_recompute(model, flat, policy="min_memory")
        return _compiled(model, args)
    blocks = [
        keras.Sequential(block, name=f"block_{i}")
        for i, block in enumerate(layers)
    ]
    if case == "tf_recompute_grad":
        for block in blocks:
            block.build((None, w))
        blocks = [TFRecomputeGrad(block) for block in blocks]
    model = keras.Sequential(
        [keras.Input((w,)), *blocks, keras.layers.Dense(1)]
    )

    def is_block(layer):
        return layer.name.startswith("block_")

    if case == "per_block":
        model = apply_recompute(model, layers=is_block, in_place=False)
    elif case == "in_place":
        apply_recompute(model, layers=is_block, in_place=True)
    elif case == "sqrt":
        model = apply_recompute(
            model, layers=is_block, policy="sqrt", in_place=False
        )
    elif case == "min_memory":
        apply_recompute(model, layers=is_block, policy="min_memory")
    return _compiled(model, args)


def _compiled(model, args: argparse.Namespace):
    import numpy as np

    model.compile(optimizer="sgd", loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.width)).astype("float32")
    y = rng.normal(size=(args.batch, 1)).astype("float32")
    wrappers = sum(
        type(layer).__name__ == "RecomputeGrad" for layer in model.layers
    )
    return model, x, y, wrappers


def _step(model, x, y) -> None:
    import numpy as np

    loss = model.train_on_batch(x, y)
    float(np.asarray(loss).ravel()[0])  # wait for the step to finish


def memory_child(args: argparse.Namespace) -> dict:
    """Peak memory of one case, alone in this process."""
    from keras_mgpu._flavour import tf

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    model, x, y, wrappers = build_model(args.child, args)
    rss_before = _current_rss()
    _step(model, x, y)  # trace and warm up
    _step(model, x, y)
    try:
        tf.config.experimental.reset_memory_stats(device)
        before = tf.config.experimental.get_memory_info(device)["current"]
    except ValueError:  # no allocator statistics (oneDNN off on CPU)
        before = None
    for _ in range(args.memory_steps):
        _step(model, x, y)
    peak = None
    if before is not None:
        peak = tf.config.experimental.get_memory_info(device)["peak"] - before
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {
        "device": device,
        "wrappers": wrappers,
        "step_peak_mib": None if peak is None else round(peak / 2**20, 1),
        "rss_growth_mib": round((rss - rss_before) / 2**20, 1),
    }


def graph_size(model, x, y) -> dict:
    """Ops of `model`'s train function as traced and as it runs (after
    Grappler), from TensorFlow's run metadata of its first, tracing step
    (`tensorflow.python.eager.context.enable_run_metadata`, private,
    TensorFlow 2.21). Call before the model's first step."""
    from tensorflow.python.eager import context

    context.enable_run_metadata()
    try:
        _step(model, x, y)
        metadata = context.export_run_metadata()
    finally:
        context.disable_run_metadata()
    graphs = list(metadata.function_graphs)
    if not graphs:  # pragma: no cover - already traced
        return {}
    main = max(graphs, key=lambda g: len(g.pre_optimization_graph.node))
    optimized = main.post_optimization_graph.node
    return {
        "graph_ops": len(main.pre_optimization_graph.node),
        "optimized_ops": len(optimized),
        "matmuls": sum("MatMul" in node.op for node in optimized),
    }


def time_cases(args: argparse.Namespace) -> tuple[dict, dict, dict]:
    """Step times of each case, each step paired with a plain step run
    right before or after it (ABAB... then BABA...), and graph sizes.

    Returns (step times per case, ratios to the paired plain step per
    case, graph sizes per case)."""
    models = {case: build_model(case, args) for case in args.cases}
    sizes = {}
    for case, (model, x, y, _) in models.items():
        sizes[case] = graph_size(model, x, y)  # traces
        _step(model, x, y)

    def timed(case: str) -> float:
        model, x, y, _ = models[case]
        start = time.perf_counter()
        _step(model, x, y)
        return time.perf_counter() - start

    others = args.cases[1:]
    times: dict = {case: [] for case in args.cases}
    ratios: dict = {case: [] for case in others}
    for round_index in range(args.rounds):
        # Rotate the order so no case always follows the same one, and
        # alternate which of a pair runs first.
        shift = round_index % len(others)
        for case in others[shift:] + others[:shift]:
            for step in range(args.steps):
                if (round_index + step) % 2:
                    t, t0 = timed(case), timed("none")
                else:
                    t0, t = timed("none"), timed(case)
                times["none"].append(t0)
                times[case].append(t)
                ratios[case].append(t / max(t0, 1e-9))
    return times, ratios, sizes


def memory_cases(args: argparse.Namespace) -> dict:
    """`--memory-repeats` peaks per case, one subprocess each, the cases
    alternated."""
    runs: dict = {case: [] for case in args.cases}
    for _ in range(args.memory_repeats):
        for case in args.cases:
            runs[case].append(_run_memory_child(case, args))
    return runs


def _run_memory_child(case: str, args: argparse.Namespace) -> dict:
    names = ("blocks", "width", "batch", "depth", "memory_steps")
    return run_child(
        __file__,
        ["--child", case, *options(args, names)],
        env={"TF_ENABLE_ONEDNN_OPTS": "1"},
    )


def _kept_activations(case: str, args: argparse.Namespace) -> int | None:
    """The activations `case` keeps at its peak on the deep MLP: per block,
    the input, the block boundaries and one block's activations (see the
    module docstring); the min_memory cases, what their plan stores
    (`min_memory_sizes` on blocks of `depth` activations handing on one, or
    on single layers). None for other stacks."""
    if not args.depth:
        return None
    from keras_mgpu.layers.min_memory_segments import min_memory_sizes

    if case in ("per_block", "in_place", "tf_recompute_grad"):
        return args.blocks + args.depth
    if case in ("min_memory", "min_memory_layers"):
        per_unit = args.depth if case == "min_memory" else 1
        units = args.blocks * args.depth if per_unit == 1 else args.blocks
        sizes = min_memory_sizes(
            [per_unit] * units, [1] * units, [False] * units
        )
        return 1 + max(i + size * per_unit for i, size in enumerate(sizes))
    return None


def _plain_activations(args: argparse.Namespace) -> int:
    """Every layer's output and the input."""
    return args.blocks * args.depth + 1


def _activation_floor(case: str, args: argparse.Namespace) -> float | None:
    """`case`'s kept activations over plain training's."""
    kept = _kept_activations(case, args)
    return None if kept is None else round(kept / _plain_activations(args), 3)


def _bound_at_peak(
    case: str, args: argparse.Namespace, plain_mib: float | None
):
    """Plain's measured peak less the activations `case` does not keep (one
    layer's output is batch * width float32), as a ratio: the peak if the
    recomputed step held plain's buffers besides its kept activations. The
    allocator timeline shows recomputed peaks hold one or two weight-sized
    buffers more than plain's, so a case may come out a little above it;
    tests/layers/test_recompute_memory.py bounds each peak by its kept
    activations plus one layer's backward buffers instead. None for other
    stacks."""
    kept = _kept_activations(case, args)
    if kept is None or not plain_mib:
        return None
    activation = args.batch * args.width * 4 / 2**20
    dropped = _plain_activations(args) - kept
    return round((plain_mib - dropped * activation) / plain_mib, 3)


def _target_met(case, args, memory_ratio, time_ratio):
    """The issues' targets: sqrt <= 0.5x memory at <= 1.4x time; per block
    on a deep MLP (`--depth`) <= 0.35x memory at <= 1.40x time."""
    if memory_ratio is None:
        return None
    if case == "sqrt":
        return bool(memory_ratio <= 0.5 and time_ratio <= 1.4)
    if args.depth and case in (
        "per_block",
        "in_place",
        "min_memory",
        "min_memory_layers",
    ):
        return bool(memory_ratio <= 0.35 and time_ratio <= 1.40)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=24)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="per round")
    parser.add_argument(
        "--depth", type=int, default=0, help="Dense w ReLU layers per block"
    )
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument(
        "--memory-repeats",
        type=int,
        default=3,
        help="memory subprocesses per case (median); 0: time only",
    )
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--deep", action="store_true")
    parser.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated, from {','.join(CASES)} (none always runs)",
    )
    parser.add_argument("--child", choices=CASES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    chosen = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(chosen) - set(CASES))
    if unknown:
        parser.error(f"--cases: unknown {unknown}; choose from {CASES}")
    args.cases = ["none"] + [c for c in CASES[1:] if c in chosen]
    if args.quick:
        args.blocks, args.width, args.batch = 12, 128, 512
        args.rounds, args.steps = 3, 2
        args.memory_repeats = min(args.memory_repeats, 1)
    if args.deep:  # the deep MLP, unless sizes are given
        args.depth = args.depth or 4
        args.blocks = 8 if args.blocks == 24 else args.blocks
        args.width = 1536 if args.width == 256 else args.width
    if args.child:
        print(json.dumps(memory_child(args)))
        return
    memory_runs = memory_cases(args)
    times, ratios, sizes = time_cases(args)
    rows = {}
    for case in args.cases:
        runs = memory_runs[case]
        good = [r for r in runs if "error" not in r]
        row = {
            "case": case,
            "blocks": args.blocks,
            "width": args.width,
            "batch": args.batch,
            "depth": args.depth,
            "step_time_ms": round(1000 * statistics.median(times[case]), 2),
            "step_time_ms_runs": [round(1000 * t, 1) for t in times[case]],
            **sizes[case],
        }
        if runs and not good:
            row["error"] = runs[-1]["error"]
        elif good:
            row["device"] = good[0]["device"]
            row["wrappers"] = good[0]["wrappers"]
            for key in ("step_peak_mib", "rss_growth_mib"):
                values = [r[key] for r in good if r[key] is not None]
                row[key] = statistics.median(values) if values else None
                row[f"{key}_runs"] = values
        rows[case] = row
        print(json.dumps(row), flush=True)
    base = rows["none"]
    for case in args.cases[1:]:
        row = rows[case]
        if "error" in row or "error" in base:
            continue
        key, memory_ratio = None, None
        if "step_peak_mib" in base:  # --memory-repeats 0: time only
            key = "step_peak_mib" if base["step_peak_mib"] else "rss_growth_mib"
            memory_ratio = row[key] / max(base[key], 1e-9)
        # Paired step by step: load that changes between pairs cancels.
        time_ratio = statistics.median(ratios[case])
        print(
            json.dumps(
                {
                    "ratio": f"{case}/none",
                    "memory_measure": key,
                    "memory": None
                    if memory_ratio is None
                    else round(memory_ratio, 3),
                    "step_time": round(time_ratio, 3),
                    "step_time_pairs": [round(r, 3) for r in ratios[case]],
                    "extra_ops": row["optimized_ops"] - base["optimized_ops"],
                    "extra_matmuls": row["matmuls"] - base["matmuls"],
                    "activation_floor": _activation_floor(case, args),
                    "bound_at_peak": _bound_at_peak(
                        case, args, base.get("step_peak_mib")
                    ),
                    "target_met": _target_met(
                        case, args, memory_ratio, time_ratio
                    ),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

"""Benchmark: in-place recompute on keras-hub transformer models.

Two random-init keras-hub models (no download), each trained with
`train_on_batch` at a sequence length where attention activations dominate
memory:

- encoder: a `BertBackbone` inside a user classifier; cases `none` and
  `per_layer` (every `TransformerEncoder` recomputed in place);
- decoder: a `GPT2CausalLM`; cases `none`, `per_layer` and `sqrt` (the
  `TransformerDecoder` stack in ceil(sqrt(n)) segments).

Recompute is switched on with `apply_recompute(model, ..., in_place=True)`:
the model keeps its keras-hub class.

Step time: every case of a model lives in one process and their steps are
interleaved round by round, so a busy machine slows all alike; the median
step of each is reported. Memory: each case runs alone in a subprocess with
`TF_ENABLE_ONEDNN_OPTS=1` (TensorFlow keeps CPU allocator statistics only
with oneDNN on); the figure is the allocator's peak during the measured
steps minus what was resident before them (weights, optimizer slots), on
"GPU:0" when a GPU is present, otherwise "CPU:0".

Prints one JSON line per case, then one line of ratios per case against
`none` of the same model.

    python benchmarks/bench_recompute_hub.py              # seq 512
    python benchmarks/bench_recompute_hub.py --quick      # seq 128
    python benchmarks/bench_recompute_hub.py --seq 1024 --layers 8
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

from _child import options, run_child

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = {
    "encoder": ("none", "per_layer"),
    "decoder": ("none", "per_layer", "sqrt"),
}


def _sizes(args: argparse.Namespace) -> dict:
    return dict(
        vocabulary_size=args.vocab,
        num_layers=args.layers,
        num_heads=args.heads,
        hidden_dim=args.hidden,
        intermediate_dim=4 * args.hidden,
        max_sequence_length=args.seq,
        dropout=0.1,
    )


def _keras_hub():
    try:
        import keras_hub
    except ImportError as exc:  # pragma: no cover - depends on install
        raise ImportError(
            'This benchmark needs keras-hub: pip install "keras-mgpu[hub]"'
        ) from exc
    return keras_hub


def _encoder(args: argparse.Namespace):
    keras_hub = _keras_hub()

    from keras_mgpu._flavour import keras

    backbone = keras_hub.models.BertBackbone(**_sizes(args))
    inputs = {
        name: keras.Input((args.seq,), dtype="int32", name=name)
        for name in ("token_ids", "segment_ids", "padding_mask")
    }
    pooled = backbone(inputs)["pooled_output"]
    outputs = keras.layers.Dense(2, name="head")(pooled)
    model = keras.Model(inputs, outputs, name="classifier")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, backbone, loss, keras_hub.layers.TransformerEncoder


def _decoder(args: argparse.Namespace):
    keras_hub = _keras_hub()

    from keras_mgpu._flavour import keras

    backbone = keras_hub.models.GPT2Backbone(**_sizes(args))
    model = keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    return model, backbone, loss, keras_hub.layers.TransformerDecoder


def build(kind: str, case: str, args: argparse.Namespace):
    """The model of `kind` for `case`, compiled, and one batch."""
    import numpy as np

    from keras_mgpu._flavour import keras
    from keras_mgpu.layers import apply_recompute, recomputed_layers

    keras.utils.set_random_seed(0)
    maker = _encoder if kind == "encoder" else _decoder
    model, backbone, loss, block = maker(args)
    if case != "none":
        policy = "sqrt" if case == "sqrt" else "per_layer"
        apply_recompute(model, block, policy=policy, in_place=True)
    model.compile(optimizer="sgd", loss=loss)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq)
    x = {
        "token_ids": rng.integers(1, args.vocab, shape).astype("int32"),
        "padding_mask": np.ones(shape, "int32"),
    }
    if kind == "encoder":
        x["segment_ids"] = np.zeros(shape, "int32")
        y = rng.integers(0, 2, (args.batch,)).astype("int32")
    else:
        y = rng.integers(1, args.vocab, shape).astype("int32")
    classes = f"{type(model).__name__}({type(backbone).__name__})"
    return model, x, y, len(recomputed_layers(model)), classes


def _step(model, x, y) -> None:
    import numpy as np

    loss = model.train_on_batch(x, y)
    float(np.asarray(loss).ravel()[0])  # wait for the step to finish


def memory_child(args: argparse.Namespace) -> dict:
    """Peak memory of one case, alone in this process."""
    from keras_mgpu._flavour import tf

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    kind, case = args.child.split(":")
    model, x, y, recomputed, cls = build(kind, case, args)
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
    return {
        "device": device,
        "classes": cls,
        "recomputed_layers": recomputed,
        "step_peak_mib": None if peak is None else round(peak / 2**20, 1),
    }


def time_cases(kind: str, args: argparse.Namespace) -> dict:
    """Median step time of each case of `kind`, steps interleaved."""
    cases = CASES[kind]
    models = {case: build(kind, case, args) for case in cases}
    for model, x, y, _, _ in models.values():
        _step(model, x, y)  # trace
        _step(model, x, y)
    times: dict = {case: [] for case in cases}
    for round_index in range(args.rounds):
        shift = round_index % len(cases)
        for case in cases[shift:] + cases[:shift]:
            model, x, y, _, _ = models[case]
            for _ in range(args.steps):
                start = time.perf_counter()
                _step(model, x, y)
                times[case].append(time.perf_counter() - start)
    return {case: statistics.median(t) for case, t in times.items()}


def _run_memory_child(kind: str, case: str, args) -> dict:
    names = ("layers", "hidden", "heads", "seq", "batch", "vocab")
    return run_child(
        __file__,
        ["--child", f"{kind}:{case}", *options(args, (*names, "memory_steps"))],
        env={"TF_ENABLE_ONEDNN_OPTS": "1"},
    )


def _report(kind: str, args: argparse.Namespace) -> None:
    cases = CASES[kind]
    memory = {case: _run_memory_child(kind, case, args) for case in cases}
    step_times = time_cases(kind, args)
    rows = {}
    for case in cases:
        rows[case] = {
            "model": kind,
            "case": case,
            "layers": args.layers,
            "hidden": args.hidden,
            "seq": args.seq,
            "batch": args.batch,
            "step_time_ms": round(1000 * step_times[case], 1),
            **memory[case],
        }
        print(json.dumps(rows[case]), flush=True)
    base = rows["none"]
    for case in cases[1:]:
        row = rows[case]
        if "error" in row or "error" in base or not base["step_peak_mib"]:
            continue
        ratio = {
            "ratio": f"{kind} {case}/none",
            "memory": round(row["step_peak_mib"] / base["step_peak_mib"], 3),
            "step_time": round(row["step_time_ms"] / base["step_time_ms"], 3),
        }
        print(json.dumps(ratio), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=2, help="per round")
    parser.add_argument("--memory-steps", type=int, default=2)
    parser.add_argument("--models", default="encoder,decoder")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.layers, args.seq, args.rounds, args.steps = 4, 128, 2, 1
    if args.child:
        print(json.dumps(memory_child(args)))
        return
    for kind in args.models.split(","):
        _report(kind, args)


if __name__ == "__main__":
    main()

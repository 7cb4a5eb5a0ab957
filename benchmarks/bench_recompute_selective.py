"""Benchmark: selective recompute on keras-hub GPT-2 and Llama backbones.

Random-init backbones built from configs (no download), trained one step at
a time on a squared-output loss. Cases, all in place on the backbone's
transformer layers:

- `none`: plain;
- `per_layer`: `apply_recompute(backbone, Decoder)` (full recompute of
  each layer, its input kept);
- `selective`: `apply_recompute(backbone, Decoder, policy="selective")`
  (matrix products kept, attention core, softmax, dropout, activations and
  norms recomputed);
- `raw`: the framework's own tool, no keras_mgpu. TensorFlow:
  `tf.recompute_grad` around each layer's call (its dropout masks are
  redrawn in the backward pass, so its gradients are wrong with dropout;
  shown for cost only). JAX: `jax.checkpoint` of the whole loss with
  `jax.checkpoint_policies.dots_with_no_batch_dims_saveable`.

Activation memory, each case alone in a subprocess. JAX
(`activation_mib`): bytes of the residuals the backward pass keeps
(`keras_mgpu.backend.jax.recompute_memory.residual_bytes`, read from the
program; the CPU allocator shows nothing). TensorFlow, two figures with
`TF_ENABLE_ONEDNN_OPTS=1` (allocator statistics): `tape_mib`, what an
eager `GradientTape` holds after the forward pass (the activations kept for
the backward pass, the quantity JAX's residuals measure), and
`activation_mib`, the allocator's peak during two compiled steps minus what
was resident before them (activations *and* the weight gradients, which no
recompute removes; as `bench_recompute.py`).

`regions`: how many recomputed regions the case runs per step (a
`jax.checkpoint` or `tf.custom_gradient` each).

Step time: every case of a model in one process, steps interleaved round by
round, the starting case rotated (a busy machine slows all alike), median
per case. Each row carries the load average when it was written.

One JSON line per case, then ratios against `none`; `--out FILE` appends
them to FILE too (`benchmarks/results/recompute_selective.jsonl`).

    KERAS_BACKEND=jax python benchmarks/bench_recompute_selective.py
    python benchmarks/bench_recompute_selective.py --hidden 256 --seq 1024
    python benchmarks/bench_recompute_selective.py --quick
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = ("none", "per_layer", "selective", "raw")


def _backend() -> str:
    from keras_mgpu._flavour import keras

    return keras.backend.backend()


def build(kind: str, case: str, args: argparse.Namespace):
    """(backbone, inputs, decoder class) for `case`."""
    import keras_hub
    import numpy as np

    from keras_mgpu._flavour import keras
    from keras_mgpu.layers import apply_recompute

    keras.utils.set_random_seed(0)
    if kind == "gpt2":
        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=args.vocab,
            num_layers=args.layers,
            num_heads=args.hidden // 64,
            hidden_dim=args.hidden,
            intermediate_dim=4 * args.hidden,
            max_sequence_length=args.seq,
            dropout=0.1,
        )
        block = keras_hub.layers.TransformerDecoder
    else:
        backbone = keras_hub.models.LlamaBackbone(
            vocabulary_size=args.vocab,
            num_layers=args.layers,
            num_query_heads=args.hidden // 64,
            num_key_value_heads=args.hidden // 64,
            hidden_dim=args.hidden,
            intermediate_dim=(8 * args.hidden) // 3,
            dropout=0.1,
        )
        from keras_hub.src.models.llama.llama_decoder import (
            LlamaTransformerDecoder,
        )

        block = LlamaTransformerDecoder
    if case in ("per_layer", "selective"):
        apply_recompute(backbone, block, policy=case)
    elif case == "raw" and _backend() == "tensorflow":
        _raw_tf(backbone, block)
    _REGIONS[case] = _count_regions(backbone, block, case)
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq)
    x = {
        "token_ids": rng.integers(1, args.vocab, shape).astype("int32"),
        "padding_mask": np.ones(shape, "int32"),
    }
    return backbone, x


_REGIONS: dict = {}


def _count_regions(backbone, block, case: str) -> int:
    """Recomputed regions per step (see the module docstring)."""
    from keras_mgpu.layers import recompute_in_place as switches

    if case == "none":
        return 0
    if case == "raw":  # JAX: the whole loss; TensorFlow: each block
        return 1 if _backend() == "jax" else len(_blocks(backbone, block))
    count = 0
    for layer in backbone._flatten_layers(include_self=False):
        d = layer.__dict__
        count += switches.is_switched_per_layer(layer)
        count += "_compute_attention" in d
        count += switches._ACTIVATION_MARK in d
    return count


def _blocks(backbone, block) -> list:
    return [
        layer
        for layer in backbone._flatten_layers(include_self=False)
        if isinstance(layer, block)
    ]


def _raw_tf(backbone, block) -> None:
    import functools

    from keras_mgpu._flavour import tf

    for layer in backbone._flatten_layers(include_self=False):
        if isinstance(layer, block):
            plain = functools.partial(type(layer).call, layer)

            def call(*a, _plain=plain, **kw):
                return tf.recompute_grad(lambda *t: _plain(*t, **kw))(*a)

            object.__setattr__(layer, "call", call)


def _loss(y_pred):
    from keras_mgpu._flavour import keras

    return keras.ops.mean(keras.ops.square(keras.ops.cast(y_pred, "float32")))


def make_step(backbone, case: str):
    """A compiled SGD training step `step(x) -> loss`."""
    if _backend() == "jax":
        import jax

        def loss_fn(trainable, non_trainable, x):
            y, new = backbone.stateless_call(
                trainable, non_trainable, x, training=True
            )
            return _loss(y), new

        if case == "raw":
            loss_fn = jax.checkpoint(
                loss_fn,
                policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            )
        grad = jax.value_and_grad(loss_fn, has_aux=True)

        @jax.jit
        def update(trainable, non_trainable, x):
            (loss, new), grads = grad(trainable, non_trainable, x)
            trainable = [v - 1e-3 * g for v, g in zip(trainable, grads)]
            return loss, trainable, new

        state = {
            "t": [v.value for v in backbone.trainable_variables],
            "n": [v.value for v in backbone.non_trainable_variables],
        }

        def step(x):
            loss, state["t"], state["n"] = update(state["t"], state["n"], x)
            return float(loss)

        return step, loss_fn, state

    from keras_mgpu._flavour import tf

    variables = backbone.trainable_variables

    @tf.function
    def update(x):
        with tf.GradientTape() as tape:
            loss = _loss(backbone(x, training=True))
        for v, g in zip(variables, tape.gradient(loss, variables)):
            if g is not None:  # Llama's untied output embedding: unused
                v.assign_sub(1e-3 * tf.convert_to_tensor(g))
        return loss

    def step(x):
        return float(update(x))

    return step, None, None


def memory(kind: str, case: str, args: argparse.Namespace) -> dict:
    """Activation memory of one case (see the module docstring)."""
    backbone, x = build(kind, case, args)
    step, loss_fn, state = make_step(backbone, case)
    if _backend() == "jax":
        from keras_mgpu.backend.jax.recompute_memory import residual_bytes

        def scalar(t, n, x):
            return loss_fn(t, n, x)[0]

        kept = residual_bytes(scalar, state["t"], state["n"], x)
        return {
            "activation_mib": round(kept / 2**20, 1),
            "measure": "resid",
            "regions": _REGIONS.get(case),
        }
    from keras_mgpu._flavour import tf

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    tape_mib = _tape_held(backbone, x, device)
    step(x)
    step(x)
    tf.config.experimental.reset_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)["current"]
    for _ in range(2):
        step(x)
    peak = tf.config.experimental.get_memory_info(device)["peak"] - before
    return {
        "activation_mib": round(peak / 2**20, 1),
        "measure": "peak",
        "tape_mib": tape_mib,
        "regions": _REGIONS.get(case),
    }


def _tape_held(backbone, x, device: str) -> float:
    """MiB an eager `GradientTape` holds after the forward pass."""
    import gc

    from keras_mgpu._flavour import tf

    def forward():
        with tf.GradientTape() as tape:
            loss = _loss(backbone(x, training=True))
        return tape, loss

    tape, loss = forward()  # warm-up: first-call allocations
    tape.gradient(loss, backbone.trainable_variables)
    del tape, loss
    gc.collect()
    before = tf.config.experimental.get_memory_info(device)["current"]
    tape, loss = forward()
    held = tf.config.experimental.get_memory_info(device)["current"] - before
    del tape, loss
    return round(held / 2**20, 1)


def _memory_child(kind: str, case: str, args) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--child"]
    cmd.append(f"{kind}:{case}")
    for name in ("layers", "hidden", "seq", "batch", "vocab"):
        cmd += [f"--{name}", str(getattr(args, name))]
    env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1"}
    out = subprocess.run(
        cmd, capture_output=True, text=True, check=False, env=env
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        return {"error": out.stderr[-1500:]}
    return json.loads(lines[-1])


def time_cases(kind: str, args: argparse.Namespace) -> dict:
    steps = {}
    for case in CASES:
        backbone, x = build(kind, case, args)
        step = make_step(backbone, case)[0]
        step(x)  # trace and compile
        steps[case] = (step, x)
    times: dict = {case: [] for case in CASES}
    for round_index in range(args.rounds):
        shift = round_index % len(CASES)
        for case in CASES[shift:] + CASES[:shift]:
            step, x = steps[case]
            start = time.perf_counter()
            step(x)
            times[case].append(time.perf_counter() - start)
    return {case: statistics.median(t) for case, t in times.items()}


def report(kind: str, args: argparse.Namespace) -> list:
    if args.memory == "0":
        mem = {case: {"activation_mib": None} for case in CASES}
    else:
        mem = {case: _memory_child(kind, case, args) for case in CASES}
    times = time_cases(kind, args)
    rows = []
    load = [round(x, 2) for x in os.getloadavg()]
    for case in CASES:
        row = {
            "backend": _backend(),
            "model": kind,
            "case": case,
            "layers": args.layers,
            "hidden": args.hidden,
            "seq": args.seq,
            "batch": args.batch,
            "step_time_ms": round(1000 * times[case], 1),
            "rounds": args.rounds,
            **mem[case],
            "load_avg_1_5_15": load,
            "cpus": os.cpu_count(),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        rows.append(row)
        _emit(row, args)
    base = rows[0]
    for row in rows[1:]:
        if "error" in row or "error" in base:
            continue
        ratio = {
            "ratio": f"{_backend()} {kind} {row['case']}/none",
            "hidden": args.hidden,
            "seq": args.seq,
            "memory": round(row["activation_mib"] / base["activation_mib"], 3)
            if base["activation_mib"] and row["activation_mib"] is not None
            else None,
            "step_time": round(row["step_time_ms"] / base["step_time_ms"], 3),
            "load_avg_1_5_15": load,
        }
        if row.get("tape_mib") and base.get("tape_mib"):
            ratio["tape_memory"] = round(row["tape_mib"] / base["tape_mib"], 3)
        _emit(ratio, args)
    return rows


def _emit(record: dict, args: argparse.Namespace) -> None:
    line = json.dumps(record)
    print(line, flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    parser.add_argument(
        "--memory", default="1", help="0: step times only (no subprocesses)"
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.hidden, args.seq, args.layers = 128, 128, 2
    if args.child:
        kind, case = args.child.split(":")
        print(json.dumps(memory(kind, case, args)), flush=True)
        return
    for kind in args.models.split(","):
        report(kind, args)


if __name__ == "__main__":
    main()

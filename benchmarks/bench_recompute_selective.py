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

Activation memory. JAX: bytes of the residuals the backward pass keeps
(`keras_mgpu.backend.jax.recompute_memory.residual_bytes`, read from the
program; the CPU allocator shows nothing). TensorFlow: the allocator's peak
during two steps minus what was resident before them, each case alone in a
subprocess with `TF_ENABLE_ONEDNN_OPTS=1` (as `bench_recompute.py`).

Step time: every case of a model in one process, steps interleaved round by
round (a busy machine slows all alike), median per case.

One JSON line per case, then ratios against `none`.

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
    rng = np.random.default_rng(0)
    shape = (args.batch, args.seq)
    x = {
        "token_ids": rng.integers(1, args.vocab, shape).astype("int32"),
        "padding_mask": np.ones(shape, "int32"),
    }
    return backbone, x


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
        return {"activation_mib": round(kept / 2**20, 1), "measure": "resid"}
    from keras_mgpu._flavour import tf

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    step(x)
    step(x)
    tf.config.experimental.reset_memory_stats(device)
    before = tf.config.experimental.get_memory_info(device)["current"]
    for _ in range(2):
        step(x)
    peak = tf.config.experimental.get_memory_info(device)["peak"] - before
    return {"activation_mib": round(peak / 2**20, 1), "measure": "peak"}


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
    mem = {case: _memory_child(kind, case, args) for case in CASES}
    times = time_cases(kind, args)
    rows = []
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
            **mem[case],
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = rows[0]
    for row in rows[1:]:
        if "error" in row or "error" in base or not base["activation_mib"]:
            continue
        print(
            json.dumps(
                {
                    "ratio": f"{_backend()} {kind} {row['case']}/none",
                    "hidden": args.hidden,
                    "seq": args.seq,
                    "memory": round(
                        row["activation_mib"] / base["activation_mib"], 3
                    ),
                    "step_time": round(
                        row["step_time_ms"] / base["step_time_ms"], 3
                    ),
                }
            ),
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--vocab", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--quick", action="store_true")
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

"""Benchmark: recompute on Keras's JAX backend, against plain, Keras's own
`RematScope` and raw `jax.checkpoint`.

A stack of residual MLP blocks (x + Dense(w)(Dense(w, relu)(x)), the blocks'
layers flat in one functional graph), a Dense head, MSE. Cases:

- `plain`: no recompute.
- `per_layer`: `apply_recompute(model, policy="per_layer")`, each layer alone.
- `per_block`: each residual block one recomputed unit (`group_by`).
- `sqrt`, `min_memory`: those policies over the blocks (`group_by`).
- `per_layer_offload`, `per_block_offload`: as `per_layer` / `per_block`
  with `offload=True` (what each unit keeps lives in pinned host memory).
- `remat_scope`: the blocks' layers built under `keras.RematScope(mode=
  "full")` (Keras rematerializes each layer's call alone).
- `raw_checkpoint`: the same network written in JAX, the sqrt segments of
  blocks under `jax.checkpoint`, trained by a jitted SGD step (a reference
  for what the Keras machinery costs).

Per case, one JSON line:
- `residual_mib`: what the backward pass keeps between the passes on the
  device (the residuals of `jax.vjp` of the loss, arguments excluded);
  `host_residual_mib`: what it keeps in host memory (offload).
- `backward_peak_mib`: the most intermediate values alive at once in the
  gradient program run in order (a checkpointed region's recomputation
  included): a static estimate of the activation peak, any device.
- `peak_mib`: on a GPU, `jax.devices()[0].memory_stats()["peak_bytes_in_use"]`
  after a few training steps, each case in a subprocess of its own (the
  peak is per process; XLA_PYTHON_CLIENT_PREALLOCATE=false is set before
  JAX starts). None on CPU (`memory_stats()` is None there).
- `compiled_temp_mib`: on a GPU, XLA's compiled memory analysis of the
  gradient step (on CPU it does not show recompute: not read there).
- `train_step_temp_mib`, `train_step_remat_copies`: in the peak's
  subprocess, XLA's compiled memory analysis of the step `fit` runs (Keras's
  own `train_step`, jitted with its state donated as Keras jits it), and
  how many instructions of its optimized program XLA's rematerialization
  pass made (their names end in ".remat"): where plain's measured peak is
  below its own activations, this says whether XLA recomputed by itself.
- `step_ms` and `time_ratio`: Keras cases run `train_on_batch`; each step is
  paired with a plain step right before or after it (alternating), and the
  ratio is the median of the pairs' ratios, so load that changes between
  pairs cancels.

Then one line of ratios against plain. Imports nothing from TensorFlow.

    python benchmarks/bench_recompute_jax.py --quick   # CPU, < 30 s
    python benchmarks/bench_recompute_jax.py --gpu     # 24 x Dense-2048, 8192
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import numpy as np  # noqa: E402
from _child import run_child  # noqa: E402

import keras_mgpu  # noqa: E402
from keras_mgpu.backend.jax import recompute_memory  # noqa: E402

CASES = (
    "plain",
    "per_layer",
    "per_block",
    "sqrt",
    "min_memory",
    "per_layer_offload",
    "per_block_offload",
    "remat_scope",
    "raw_checkpoint",
)
MIB = 1024 * 1024


def _block_of(layer) -> str | None:
    parts = layer.name.split("_")
    return parts[1] if parts[0] == "block" else None


def build_model(case: str, args: argparse.Namespace):
    """The Keras model of `case` (`raw_checkpoint` reuses plain's)."""
    inputs = keras.Input((args.width,))

    def layers():
        made = []
        for i in range(args.blocks):
            made.append(
                (
                    keras.layers.Dense(
                        args.width, activation="relu", name=f"block_{i}_a"
                    ),
                    keras.layers.Dense(args.width, name=f"block_{i}_b"),
                    keras.layers.Add(name=f"block_{i}_add"),
                )
            )
        return made

    if case == "remat_scope":
        with keras.RematScope(mode="full"):
            blocks = layers()
    else:
        blocks = layers()
    x = inputs
    for a, b, add in blocks:
        x = add([x, b(a(x))])
    outputs = keras.layers.Dense(1, name="head")(x)
    model = keras.Model(inputs, outputs)
    offload = case.endswith("_offload")
    case = case.removesuffix("_offload")
    if case == "per_layer":
        keras_mgpu.apply_recompute(model, policy="per_layer", offload=offload)
    elif case == "per_block":
        keras_mgpu.apply_recompute(model, group_by=_block_of, offload=offload)
    elif case in ("sqrt", "min_memory"):
        keras_mgpu.apply_recompute(model, policy=case, group_by=_block_of)
    return model


def data(args: argparse.Namespace):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch, args.width)).astype("float32")
    y = rng.normal(size=(args.batch, 1)).astype("float32")
    return x, y


# ---------------------------------------------------------------------------
# The same network in JAX, sqrt segments of blocks under jax.checkpoint.
# ---------------------------------------------------------------------------


def raw_params(model) -> list:
    return [jnp.asarray(v.value) for v in model.trainable_variables]


def raw_loss(args: argparse.Namespace):
    size = math.ceil(math.sqrt(args.blocks))

    def segment(params, x):
        for i in range(0, len(params), 4):
            k1, b1, k2, b2 = params[i : i + 4]
            x = x + (jax.nn.relu(x @ k1 + b1) @ k2 + b2)
        return x

    checkpointed = jax.checkpoint(segment)

    def loss(params, x, y):
        blocks, (kh, bh) = params[:-2], params[-2:]
        for start in range(0, args.blocks, size):
            x = checkpointed(blocks[start * 4 : (start + size) * 4], x)
        return jnp.mean(jnp.square(x @ kh + bh - y))

    return loss


def raw_step(args: argparse.Namespace):
    loss = raw_loss(args)

    @jax.jit
    def step(params, x, y):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return [p - 0.01 * g for p, g in zip(params, grads)], value

    return step


# ---------------------------------------------------------------------------
# Readings.
# ---------------------------------------------------------------------------


def static_memory(case: str, model, args: argparse.Namespace) -> dict:
    x, y = data(args)
    if case == "raw_checkpoint":
        loss = raw_loss(args)
        params = raw_params(model)
        kept = recompute_memory.residual_bytes(loss, params, x, y)
        host = 0
        peak = recompute_memory.backward_peak_bytes(loss, params, x, y)
    else:
        kept = recompute_memory.model_residual_bytes(
            model, x, y, memory="device"
        )
        host = recompute_memory.model_residual_bytes(model, x, y, memory="host")
        peak = recompute_memory.model_backward_peak_bytes(model, x, y)
    return {
        "residual_mib": kept / MIB,
        "host_residual_mib": host / MIB,
        "backward_peak_mib": peak / MIB,
    }


def compiled_temp(case: str, model, args: argparse.Namespace) -> float | None:
    x, y = data(args)
    try:
        if case == "raw_checkpoint":
            lowered = raw_step(args).lower(raw_params(model), x, y)
        else:
            loss = recompute_memory._step_of(model, y, None)
            grad = jax.jit(jax.grad(loss, allow_int=True))
            lowered = grad.lower(*recompute_memory._model_args(model, x))
        analysis = lowered.compile().memory_analysis()
        return None if analysis is None else analysis.temp_size_in_bytes / MIB
    except Exception:  # noqa: BLE001 - a reading, not a result
        return None


class Runner:
    """One training step of a case, ready to call."""

    def __init__(self, case: str, args: argparse.Namespace) -> None:
        self.case = case
        self.x, self.y = data(args)
        self.model = build_model(
            "plain" if case == "raw_checkpoint" else case, args
        )
        if case == "raw_checkpoint":
            self.params = raw_params(self.model)
            self.step_fn = raw_step(args)
        else:
            self.model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")

    def step(self) -> float:
        start = time.perf_counter()
        if self.case == "raw_checkpoint":
            self.params, value = self.step_fn(self.params, self.x, self.y)
            jax.block_until_ready(value)
        else:
            # The loss comes back as a NumPy value: the step has finished.
            self.model.train_on_batch(self.x, self.y)
        return time.perf_counter() - start


def time_cases(cases: list, args: argparse.Namespace) -> dict:
    plain = Runner("plain", args)
    for _ in range(3):
        plain.step()
    results = {}
    for case in cases:
        if case == "plain":
            continue
        try:
            runner = Runner(case, args)
            runner.step()  # compile
            runner.step()
        except Exception as error:  # noqa: BLE001 - reported per case
            results[case] = {"error": f"{type(error).__name__}: {error}"[:300]}
            continue
        ratios, times, plain_times = [], [], []
        for i in range(args.steps):
            if i % 2 == 0:
                a, b = plain.step(), runner.step()
            else:
                b, a = runner.step(), plain.step()
            ratios.append(b / a)
            times.append(b)
            plain_times.append(a)
        results[case] = {
            "step_ms": 1000 * statistics.median(times),
            "plain_step_ms": 1000 * statistics.median(plain_times),
            "time_ratio": statistics.median(ratios),
        }
    return results


def train_step_memory(runner: Runner) -> dict:
    """XLA's reading of the compiled step `fit` runs for a Keras case:
    temporaries and the instructions its rematerialization pass made."""
    if runner.case == "raw_checkpoint":
        return {}
    model = runner.model
    state = tuple(
        [
            jax.ShapeDtypeStruct(
                v.value.shape, v.value.dtype, sharding=v.value.sharding
            )
            for v in variables
        ]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )
    batch = (runner.x, runner.y)
    step = jax.jit(model.train_step, donate_argnums=0)
    compiled = step.lower(state, batch).compile()
    analysis = compiled.memory_analysis()
    return {
        "train_step_temp_mib": None
        if analysis is None
        else analysis.temp_size_in_bytes / MIB,
        "train_step_remat_copies": compiled.as_text().count(".remat"),
    }


def memory_child(case: str, args: argparse.Namespace) -> dict:
    runner = Runner(case, args)
    for _ in range(3):
        runner.step()
    stats = jax.devices()[0].memory_stats()
    peak = None if stats is None else stats.get("peak_bytes_in_use")
    row = {"case": case, "peak_mib": None if peak is None else peak / MIB}
    try:
        row.update(train_step_memory(runner))
    except Exception as error:  # noqa: BLE001 - a reading, not a result
        row["train_step_error"] = f"{type(error).__name__}: {error}"[:300]
    return row


def peak_of(case: str, argv: list) -> dict:
    """`peak_mib` of `case` from a subprocess of its own (or why not)."""
    reading = run_child(
        __file__,
        [*argv, "--child", case],
        env={"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    )
    if "error" in reading:
        tail = (reading["error"].strip().splitlines() or ["no output"])[-1]
        return {"peak_mib": None, "peak_error": tail[:300]}
    reading.pop("case", None)
    return reading


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--blocks", type=int, default=12)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=6, help="pairs per case")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument(
        "--quick", action="store_true", help="8 blocks, 128 wide, batch 256"
    )
    parser.add_argument(
        "--gpu", action="store_true", help="24 blocks, 2048 wide, batch 8192"
    )
    parser.add_argument(
        "--train-step-memory",
        action="store_true",
        help="also off a GPU: each case's compiled fit step in a subprocess",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    argv = [a for a in sys.argv[1:] if a not in ("--child", args.child)]
    if args.quick:
        args.blocks, args.width, args.batch, args.steps = 8, 128, 256, 4
    if args.gpu:
        args.blocks, args.width, args.batch = 24, 2048, 8192
    if args.child:
        print(json.dumps(memory_child(args.child, args)))
        return
    cases = [c for c in args.cases.split(",") if c]
    unknown = sorted(set(cases) - set(CASES))
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(CASES)}")
    device = jax.devices()[0]
    on_gpu = device.platform == "gpu"
    header = {
        "device": getattr(device, "device_kind", device.platform),
        "blocks": args.blocks,
        "width": args.width,
        "batch": args.batch,
        "jax": jax.__version__,
        "keras": keras.__version__,
    }
    print(json.dumps({"config": header}), flush=True)
    timing = time_cases(cases, args)
    rows = {}
    for case in cases:
        row = {"case": case}
        try:
            model = build_model(
                "plain" if case == "raw_checkpoint" else case, args
            )
            row.update(static_memory(case, model, args))
            # Not on CPU, where it does not show recompute (measured).
            row["compiled_temp_mib"] = (
                compiled_temp(case, model, args) if on_gpu else None
            )
        except Exception as error:  # noqa: BLE001 - reported per case
            row["error"] = f"{type(error).__name__}: {error}"[:300]
        row.update(
            peak_of(case, argv)
            if on_gpu or args.train_step_memory
            else {"peak_mib": None}
        )
        row.update(timing.get(case, {}))
        rows[case] = row
        print(json.dumps(row), flush=True)
    plain = rows.get("plain", {})
    ratios = {}
    for case, row in rows.items():
        if case == "plain":
            continue
        entry = {}
        for key in ("residual_mib", "backward_peak_mib", "peak_mib"):
            if row.get(key) is not None and plain.get(key):
                entry[key.replace("_mib", "_ratio")] = row[key] / plain[key]
        if "time_ratio" in row:
            entry["time_ratio"] = row["time_ratio"]
        ratios[case] = entry
    print(json.dumps({"ratios_vs_plain": ratios}), flush=True)


if __name__ == "__main__":
    main()

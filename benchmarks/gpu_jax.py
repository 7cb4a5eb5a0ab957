"""The GPU evidence for Keras 3 on JAX, in one prepared call (never in CI).

Run on a machine with an NVIDIA GPU, JAX with CUDA and no TensorFlow (the
lent machine's image), with Keras and this checkout on the path:

    python benchmarks/gpu_jax.py --out results.jsonl      # ~5 min on an H100
    python benchmarks/gpu_jax.py --quick                  # CPU smoke run

Each case runs in a subprocess of its own (a process's peak GPU memory cannot
be reset) and prints one JSON line; all lines also go to `--out`:

- `device`: the card, its memory, JAX and Keras versions;
- `monitors`: `MemoryMonitor` and `GPULoadMonitor` in a `fit` (the log keys
  and the figures they read: `memory_stats()` and NVML) and the fit's step
  time with both on / off;
- `accumulation`: `GradientAccumulationOptimizer` (K=4) against one step on
  the 4x batch with an AdamW + step schedule (max abs weight difference),
  Keras's built-in `gradient_accumulation_steps` likewise, and step times;
- `throughput`: keras-hub BERT-small (4 layers, hidden 512, seq 128, batch
  16, `DataParallel`): step time of plain Keras `fit`, with
  `ThroughputMonitor` (and what it reports: tokens/s, TFLOP/s per device,
  MFU, HFU, compile time), with accumulation K=4 + AdamW, with
  `LearningRateWarmup`, with `MemoryMonitor`, and of a hand-written
  `jax.jit` loop of the same model; ratios over plain (needs keras-hub);
- `bench_recompute_jax.py --gpu`: peak memory and step time of plain, our
  recompute policies, `keras.RematScope` and raw `jax.checkpoint`;
- `check_gpu_monitors_jax.py`: the monitors on the real `memory_stats()`
  and NVML with XLA's preallocation on and off;
- `bench_monitors_jax.py`: step time with each monitor on vs off;
- with `--selective` only: `bench_recompute_selective.py` (keras-hub GPT-2
  and Llama backbones, plain / per-layer / selective / raw `jax.checkpoint`,
  hidden 1024 seq 512 and hidden 256 seq 1024; needs keras-hub), not part of
  the default run.
(`bench_accumulation_jax.py` measures CPU devices; the `accumulation` case
above is its GPU counterpart.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _env() -> dict:
    env = dict(os.environ)
    env["KERAS_BACKEND"] = "jax"
    # Peaks mean something only without XLA's preallocated pool.
    env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _case_device(quick: bool = False) -> dict:
    import jax
    import keras

    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    return {
        "case": "device",
        "platform": device.platform,
        "device_kind": getattr(device, "device_kind", "?"),
        "devices": len(jax.devices()),
        "memory_limit_mib": round(stats.get("bytes_limit", 0) / 2**20),
        "jax": jax.__version__,
        "keras": keras.__version__,
    }


def _mlp(keras, width: int, depth: int, classes: int = 10):
    from keras_mgpu.testing import set_random_seed

    set_random_seed(0)
    layers = [keras.Input((width,))]
    layers += [
        keras.layers.Dense(width, activation="relu") for _ in range(depth)
    ]
    layers += [keras.layers.Dense(classes)]
    return keras.Sequential(layers)


def _data(width: int, samples: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, width)).astype("float32")
    y = rng.integers(0, 10, size=samples).astype("int32")
    return x, y


def _timed_fit(model, x, y, batch_size, callbacks=(), epochs=2):
    """Seconds per step of the last epoch (the first one compiles)."""
    times = []

    import keras

    class _Clock(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            self.start = time.perf_counter()

        def on_epoch_end(self, epoch, logs=None):
            times.append(time.perf_counter() - self.start)

    history = model.fit(
        x,
        y,
        batch_size=batch_size,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[*callbacks, _Clock()],
    )
    steps = len(y) // batch_size  # x may be a dict of inputs
    return times[-1] / steps, history


def _case_monitors(quick: bool) -> dict:
    import keras

    from keras_mgpu.callbacks import GPULoadMonitor, MemoryMonitor

    width, depth = (64, 2) if quick else (2048, 8)
    samples, batch = (512, 64) if quick else (65536, 4096)
    x, y = _data(width, samples)
    out = {"case": "monitors", "width": width, "depth": depth, "batch": batch}
    for label, callbacks in (
        ("off", []),
        ("on", [MemoryMonitor(update_freq=4), GPULoadMonitor(interval=0.2)]),
        ("off_again", []),
    ):
        model = _mlp(keras, width, depth)
        model.compile("adam", keras.losses.SparseCategoricalCrossentropy(True))
        seconds, history = _timed_fit(model, x, y, batch, callbacks)
        out[f"step_ms_{label}"] = round(seconds * 1e3, 3)
        if label == "on":
            out["log_keys"] = sorted(k for k in history.history if k != "loss")
            out["logs_last_epoch"] = {
                k: round(float(v[-1]), 2)
                for k, v in history.history.items()
                if k != "loss"
            }
    out["ratio_on_off"] = round(
        out["step_ms_on"]
        / ((out["step_ms_off"] + out["step_ms_off_again"]) / 2),
        3,
    )
    return out


def _case_accumulation(quick: bool) -> dict:
    """Ours and Keras's built-in (K=4) against one step on the 4x batch,
    with a step schedule: SGD with momentum (differences are the float
    rounding of a sum taken in another order) and AdamW (which divides by
    the root of the second moment: a near-zero gradient's rounding becomes
    a step of up to the learning rate, whichever way it is summed)."""
    import keras
    import numpy as np

    import keras_mgpu

    width, depth = (32, 2) if quick else (1024, 4)
    micro, k = (16, 4) if quick else (1024, 4)
    steps = 8  # updates per epoch
    x, y = _data(width, micro * k * steps)
    optimizers = {
        "sgd": lambda s: keras.optimizers.SGD(s, momentum=0.9),
        "adamw": lambda s: keras.optimizers.AdamW(s, weight_decay=0.01),
    }
    rates = {"sgd": (0.05, 0.005), "adamw": (1e-3, 1e-4)}
    out = {"case": "accumulation", "k": k, "micro_batch": micro}
    out["updates"] = 2 * steps

    def run(opt, batch):
        model = _mlp(keras, width, depth)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        model.compile(opt, loss)
        seconds, _ = _timed_fit(model, x, y, batch, epochs=2)
        return model, seconds

    for name, make in optimizers.items():

        def optimizer(name=name, make=make):
            schedule = keras.optimizers.schedules.PiecewiseConstantDecay(
                [steps // 2], list(rates[name])
            )
            return make(schedule)

        large, t_large = run(optimizer(), micro * k)
        ours, t_ours = run(
            keras_mgpu.GradientAccumulationOptimizer(optimizer(), k), micro
        )
        builtin_opt = optimizer()
        builtin_opt.gradient_accumulation_steps = k
        builtin, t_builtin = run(builtin_opt, micro)
        start = _mlp(keras, width, depth).get_weights()
        moved = max(
            float(np.max(np.abs(a - b)))
            for a, b in zip(large.get_weights(), start)
        )

        def diff(model, large=large):
            return max(
                float(np.max(np.abs(a - b)))
                for a, b in zip(model.get_weights(), large.get_weights())
            )

        out[f"{name}_large_batch_moved_max_abs"] = moved
        out[f"{name}_max_abs_diff_ours"] = diff(ours)
        out[f"{name}_max_abs_diff_builtin"] = diff(builtin)
        out[f"{name}_step_ms_micro_ours"] = round(t_ours * 1e3, 3)
        out[f"{name}_step_ms_micro_builtin"] = round(t_builtin * 1e3, 3)
        out[f"{name}_step_ms_large_batch"] = round(t_large * 1e3, 3)
        out[f"{name}_ratio_ours_builtin"] = round(t_ours / t_builtin, 3)
    return out


def _bert(keras, quick: bool):
    """keras-hub BERT-small (4 layers, hidden 512, seq 128) with a
    2-class head on the pooled output; a tiny one with `quick`."""
    import keras_hub

    if quick:
        size = {"layers": 2, "hidden": 64, "heads": 2, "vocab": 100, "seq": 16}
    else:
        size = {
            "layers": 4,
            "hidden": 512,
            "heads": 8,
            "vocab": 30522,
            "seq": 128,
        }
    keras.utils.set_random_seed(0)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=size["vocab"],
        num_layers=size["layers"],
        num_heads=size["heads"],
        hidden_dim=size["hidden"],
        intermediate_dim=4 * size["hidden"],
        max_sequence_length=size["seq"],
    )
    logits = keras.layers.Dense(2)(backbone.output["pooled_output"])
    return keras.Model(backbone.input, logits), size


def _case_throughput(quick: bool) -> dict:
    """Plain Keras `fit` of BERT-small vs each component vs a hand-written
    `jax.jit` loop of the same model (SGD), and what `ThroughputMonitor`
    reports (tokens/s, TFLOP/s per device, MFU/HFU against the table)."""
    import jax
    import jax.numpy as jnp
    import keras
    import numpy as np

    from keras_mgpu.callbacks import (
        LearningRateWarmup,
        MemoryMonitor,
        ThroughputMonitor,
    )
    from keras_mgpu.optimizers import GradientAccumulationOptimizer

    batch, steps = (4, 8) if quick else (16, 128)
    probe, size = _bert(keras, quick)
    seq = size["seq"]
    samples = batch * steps
    rng = np.random.default_rng(0)
    x = {
        "token_ids": rng.integers(0, size["vocab"], (samples, seq)).astype(
            "int32"
        ),
        "segment_ids": np.zeros((samples, seq), "int32"),
        "padding_mask": np.ones((samples, seq), "int32"),
    }
    y = rng.integers(0, 2, samples).astype("int32")
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    out = {"case": "throughput", "batch": batch, "steps": steps, **size}
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def fit(label, optimizer, callbacks=(), epochs=2, prepare=None):
        model, _ = _bert(keras, quick)
        if prepare is not None:
            prepare(model)
        model.compile(optimizer, loss)
        seconds, _ = _timed_fit(model, x, y, batch, callbacks, epochs=epochs)
        out[f"step_ms_{label}"] = round(seconds * 1e3, 3)

    fit("plain", keras.optimizers.SGD(1e-3))
    # Keras 3.15's DataParallel over ONE device compiles the step again at
    # the first step of epoch 2 (tests/test_keras_limits.py): epoch 3
    # has no compile in it, and neither has a fit without a distribution.
    fit("plain_epoch3", keras.optimizers.SGD(1e-3), epochs=3)
    keras.distribution.set_distribution(None)
    fit("plain_no_distribution", keras.optimizers.SGD(1e-3))
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    monitor = ThroughputMonitor(window_size=steps // 2, token_input="token_ids")
    fit("throughput_monitor", keras.optimizers.SGD(1e-3), [monitor])
    out["monitor"] = {k: float(f"{v:.4g}") for k, v in monitor.last.items()}
    fit(
        "accumulation_k4_adamw",
        GradientAccumulationOptimizer(
            keras.optimizers.AdamW(1e-3), accumulation_steps=4
        ),
    )
    fit(
        "warmup",
        keras.optimizers.SGD(1e-3),
        [LearningRateWarmup(warmup_steps=steps)],
    )
    fit("memory_monitor", keras.optimizers.SGD(1e-3), [MemoryMonitor()])

    def recompute_encoders(model):
        import keras_hub

        from keras_mgpu.layers import apply_recompute

        apply_recompute(model, keras_hub.layers.TransformerEncoder)

    fit(
        "recompute_per_layer",
        keras.optimizers.SGD(1e-3),
        (),
        3,
        recompute_encoders,
    )
    # examples/fine_tune_keras_hub.py's setup, epoch 3 (no compile in it).
    fit(
        "example_setup_epoch3",
        GradientAccumulationOptimizer(
            keras.optimizers.AdamW(5e-5, weight_decay=0.01),
            accumulation_steps=4,
        ),
        [LearningRateWarmup(warmup_steps=steps), MemoryMonitor()],
        3,
        recompute_encoders,
    )

    # The hand-written loop: the same model's stateless call, SGD.
    model, _ = _bert(keras, quick)
    non_trainable = [v.value for v in model.non_trainable_variables]

    def loss_fn(weights, xb, yb):
        logits, _ = model.stateless_call(weights, non_trainable, xb)
        log_probs = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(log_probs, yb[:, None], 1))

    @jax.jit
    def step(weights, xb, yb):
        value, grads = jax.value_and_grad(loss_fn)(weights, xb, yb)
        return [w - 1e-3 * g for w, g in zip(weights, grads)], value

    batches = [
        ({k: v[i : i + batch] for k, v in x.items()}, y[i : i + batch])
        for i in range(0, samples, batch)
    ]
    weights = [v.value for v in model.trainable_variables]
    weights, value = step(weights, *batches[0])
    jax.block_until_ready(value)
    start = time.perf_counter()
    for xb, yb in batches:
        weights, value = step(weights, xb, yb)
    jax.block_until_ready(value)
    out["step_ms_jit_loop"] = round(
        (time.perf_counter() - start) / steps * 1e3, 3
    )
    plain = out["step_ms_plain"]
    out["ratios_over_plain"] = {
        k[len("step_ms_") :]: round(v / plain, 3)
        for k, v in out.items()
        if k.startswith("step_ms_")
    }
    return out


CASES = {
    "device": _case_device,
    "monitors": _case_monitors,
    "accumulation": _case_accumulation,
    "throughput": _case_throughput,
}


def _run_case(name: str, quick: bool, timeout: float) -> list[dict]:
    cmd = [sys.executable, os.path.abspath(__file__), "--case", name]
    if quick:
        cmd.append("--quick")
    return _run(cmd, name, timeout)


def _json_lines(text: str) -> list[dict]:
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except ValueError:
                pass
    return rows


def _run(cmd: list[str], name: str, timeout: float) -> list[dict]:
    start = time.monotonic()
    try:
        proc = subprocess.run(
            cmd,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired as exc:
        # Keep what the case printed before its time ran out.
        stdout = exc.stdout or ""
        if isinstance(stdout, bytes):
            stdout = stdout.decode(errors="replace")
        return [
            *_json_lines(stdout),
            {"case": name, "error": f"timed out after {timeout:.0f} s"},
        ]
    rows = _json_lines(proc.stdout)
    if proc.returncode != 0 or not rows:
        rows.append(
            {
                "case": name,
                "error": f"exit {proc.returncode}",
                "stderr_tail": proc.stderr[-1500:],
            }
        )
    for row in rows:
        row.setdefault("wall_s", round(time.monotonic() - start, 1))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--case", choices=sorted(CASES))
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--selective",
        action="store_true",
        help="also run bench_recompute_selective.py (keras-hub models)",
    )
    args = parser.parse_args()
    if args.case:  # one case, in this (fresh) process
        os.environ.update(
            {k: v for k, v in _env().items() if k.startswith(("KERAS", "XLA"))}
        )
        print(json.dumps(CASES[args.case](args.quick)), flush=True)
        return 0
    quick = ["--quick"] if args.quick else []
    plan = [
        ("device", lambda: _run_case("device", args.quick, 120)),
        ("accumulation", lambda: _run_case("accumulation", args.quick, 150)),
        (
            "bench_recompute_jax",
            lambda: _run(
                [
                    sys.executable,
                    os.path.join(HERE, "bench_recompute_jax.py"),
                    *(quick or ["--gpu", "--steps", "2"]),
                ],
                "bench_recompute_jax",
                300,  # 9 cases since the two offload ones
            ),
        ),
        ("monitors", lambda: _run_case("monitors", args.quick, 150)),
        ("throughput", lambda: _run_case("throughput", args.quick, 240)),
        (
            "check_gpu_monitors_jax",
            lambda: _run(
                [
                    sys.executable,
                    os.path.join(HERE, "check_gpu_monitors_jax.py"),
                    *(quick or ["--epochs", "1", "--samples", "50000"]),
                ],
                "check_gpu_monitors_jax",
                150,
            ),
        ),
        (
            "bench_monitors_jax",
            lambda: _run(
                [
                    sys.executable,
                    os.path.join(HERE, "bench_monitors_jax.py"),
                    *(quick or ["--steps", "200", "--repeats", "3"]),
                ],
                "bench_monitors_jax",
                120,
            ),
        ),
    ]
    if args.selective:
        selective = os.path.join(HERE, "bench_recompute_selective.py")
        sizes = (
            [["--quick"]]
            if args.quick
            else [
                ["--hidden", "1024", "--seq", "512", "--batch", "4"],
                ["--hidden", "256", "--seq", "1024", "--batch", "4"],
            ]
        )
        for size in sizes:
            plan.append(
                (
                    "bench_recompute_selective",
                    lambda size=size: _run(
                        [sys.executable, selective, "--rounds", "5", *size],
                        "bench_recompute_selective",
                        300,
                    ),
                )
            )
    out = open(args.out, "w") if args.out else None
    failed = 0
    for _, run in plan:
        for row in run():
            failed += "error" in row
            line = json.dumps(row)
            print(line, flush=True)
            if out:
                out.write(line + "\n")
                out.flush()
    if out:
        out.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

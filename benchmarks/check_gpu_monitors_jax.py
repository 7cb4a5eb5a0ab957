"""The monitors on Keras's JAX backend with the real `memory_stats()` and
NVML; print JSON.

For a GPU machine (JAX with CUDA, no TensorFlow needed): runs the same short
`fit` (both monitors, `DataParallel` over the GPUs) in one child process per
allocator setting — XLA's default preallocation, then
`XLA_PYTHON_CLIENT_PREALLOCATE=false` — and prints one JSON line each: the
first GPU's `memory_stats()` before and after, the logged `mem/...` and
`gpu/...` figures of the last epoch, the monitors' warnings, and whether
TensorFlow was imported. What it settles: which figures the preallocated
pool changes (NVML's used memory certainly; `bytes_in_use`?). On a machine
without a GPU (`--quick`) the children run on CPU and log host figures.

    KERAS_BACKEND=jax python benchmarks/check_gpu_monitors_jax.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SETTINGS = {
    "preallocate_default": {},
    "preallocate_false": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
}


def child(epochs: int, samples: int, width: int) -> dict:
    import warnings

    import jax
    import keras
    import numpy as np

    from keras_mgpu.callbacks import GPULoadMonitor, MemoryMonitor

    platform = jax.default_backend()
    first = jax.local_devices()[0]

    def stats():
        found = first.memory_stats()
        return None if found is None else {k: int(v) for k, v in found.items()}

    before = stats()
    devices = keras.distribution.list_devices(platform)
    distribution = keras.distribution.DataParallel(devices=devices)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 256)).astype("float32")
    y = rng.normal(size=(samples, 1)).astype("float32")
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        with distribution.scope():
            model = keras.Sequential(
                [keras.Input((256,))]
                + [
                    keras.layers.Dense(width, activation="relu")
                    for _ in range(4)
                ]
                + [keras.layers.Dense(1)]
            )
            model.compile(optimizer="adam", loss="mse")
            history = model.fit(
                x,
                y,
                batch_size=1024,
                epochs=epochs,
                verbose=0,
                callbacks=[MemoryMonitor(), GPULoadMonitor(interval=0.1)],
            )
    logged = {
        key: values[-1]
        for key, values in history.history.items()
        if key.startswith(("mem/", "gpu/", "cpu/"))
    }
    return {
        "platform": platform,
        "device_kind": first.device_kind,
        "devices": len(devices),
        "memory_stats_before": before,
        "memory_stats_after": stats(),
        "logged_last_epoch": logged,
        "warnings": sorted({str(w.message)[:200] for w in record}),
        "tensorflow_imported": "tensorflow" in sys.modules,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=200_000)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.samples, args.width, args.epochs = 4096, 64, 1
    if args.child:
        print(json.dumps(child(args.epochs, args.samples, args.width)))
        return
    for name, extra in SETTINGS.items():
        env = {**os.environ, "KERAS_BACKEND": "jax", **extra}
        command = [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            f"--epochs={args.epochs}",
            f"--samples={args.samples}",
            f"--width={args.width}",
        ]
        out = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=600
        )
        lines = out.stdout.strip().splitlines()
        try:
            result = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            result = {"error": out.stderr[-2000:]}
        print(
            json.dumps({"bench": "gpu_monitors_jax", "setting": name, **result})
        )


if __name__ == "__main__":
    main()

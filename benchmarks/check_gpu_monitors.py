"""Exercise the real NVML and TensorFlow memory paths; print JSON.

For a GPU machine: runs a short `fit` with both monitors (real backends)
and prints one JSON line with the devices found, the first epoch's figures
and whether any sampler thread or NVML handle outlived the run. On a
machine without GPUs it prints what the fallback logged instead.

    python benchmarks/check_gpu_monitors.py [--epochs 2] [--interval 0.2]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import warnings

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--interval", type=float, default=0.2)
    parser.add_argument("--samples", type=int, default=200_000)
    args = parser.parse_args()

    import numpy as np

    from keras_mgpu._flavour import keras, tf
    from keras_mgpu.callbacks import GPULoadMonitor, MemoryMonitor
    from keras_mgpu.monitoring import NvmlBackend
    from keras_mgpu.monitoring.sampler import live_sampler_threads

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.samples, 256)).astype("float32")
    y = rng.normal(size=(args.samples, 1)).astype("float32")
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((256,)),
                keras.layers.Dense(2048, activation="relu"),
                keras.layers.Dense(2048, activation="relu"),
                keras.layers.Dense(1),
            ]
        )
        model.compile(optimizer="adam", loss="mse")
    memory = MemoryMonitor()
    load = GPULoadMonitor(interval=args.interval)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        history = model.fit(
            x,
            y,
            batch_size=1024,
            epochs=args.epochs,
            verbose=0,
            callbacks=[memory, load],
        )
    first = {
        k: (None if math.isnan(v[0]) else round(float(v[0]), 3))
        for k, v in history.history.items()
        if k.startswith(("mem/", "gpu/", "cpu/"))
    }
    nvml_open = getattr(load._backend, "is_open", None)
    backend = NvmlBackend()
    try:
        backend.open()
        uuids = backend.uuids
        backend.close()
    except Exception as exc:  # report, never fail
        uuids = f"unavailable: {exc}"
    print(
        json.dumps(
            {
                "check": "gpu_monitors",
                "tf_gpus": len(tf.config.list_physical_devices("GPU")),
                "replicas": strategy.num_replicas_in_sync,
                "nvml_gpus": uuids,
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "load_mode": load.mode,
                "memory_keys": memory.keys,
                "epoch0": first,
                "warnings": [str(w.message)[:200] for w in caught],
                "live_sampler_threads_after": len(live_sampler_threads()),
                "nvml_left_open": nvml_open,
            }
        )
    )


if __name__ == "__main__":
    main()

"""Benchmark: the step-time cost of `synchronize_batchnorm` under a
2-replica MirroredStrategy (two logical CPU devices, the default
cross-device ops users get).

For each model, two identical copies are trained side by side in one
process, one with synchronized BatchNormalization; `fit` runs alternate
between them (A, B, A, B, ...) so that machine load hits both alike, and
the median time of a training step (timed by a callback, without `fit`'s
set-up) of each is compared. Prints one JSON line per
case: model, BatchNormalization layers, global batch, median ms per step
plain and synchronized, and `ratio` = synchronized / plain.

Usage: python benchmarks/bench_batchnorm_sync.py [--quick] [--rounds N]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _strategy():
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * 2
    )
    return tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])


def _conv_net(keras):
    inputs = keras.Input((32, 32, 3))
    h = inputs
    for filters in (16, 32, 64, 64):
        h = keras.layers.Conv2D(filters, 3, padding="same", use_bias=False)(h)
        h = keras.layers.BatchNormalization()(h)
        h = keras.layers.ReLU()(h)
        h = keras.layers.MaxPooling2D()(h)
    h = keras.layers.GlobalAveragePooling2D()(h)
    return keras.Model(inputs, keras.layers.Dense(10)(h))


def _mlp(keras):
    layers = [keras.Input((256,))]
    for _ in range(4):
        layers += [keras.layers.Dense(256), keras.layers.BatchNormalization()]
    layers.append(keras.layers.Dense(10))
    return keras.Sequential(layers)


def _mobilenet(keras):
    return keras.applications.MobileNetV2(
        alpha=0.35,
        input_shape=(32, 32, 3),
        weights=None,
        classes=10,
        classifier_activation=None,
    )


CASES = {
    "conv4_bn": (_conv_net, (32, 32, 3)),
    "mlp4_bn": (_mlp, (256,)),
    "mobilenet_v2_a035": (_mobilenet, (32, 32, 3)),
}


def _StepTimer(keras, into: list):
    """A callback appending each training step's wall time (ms) to `into`:
    the step alone, without `fit`'s set-up (distributing the dataset)."""

    class StepTimer(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            self._start = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            into.append((time.perf_counter() - self._start) * 1e3)

    return StepTimer()


def _dataset(tf, shape, batch: int, steps: int):
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch * steps, *shape)).astype("float32")
    y = rng.integers(0, 10, size=(batch * steps,))
    return tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=64)
    args = parser.parse_args()
    strategy = _strategy()

    import tensorflow as tf

    from keras_mgpu import _flavour
    from keras_mgpu.normalization import (
        batchnorm_layers,
        synchronize_batchnorm,
    )

    keras = _flavour.keras
    rounds = 3 if args.quick else args.rounds
    steps = 5 if args.quick else args.steps
    for name, (build, shape) in CASES.items():
        data = _dataset(tf, shape, args.batch, steps)
        models = {}
        for variant in ("plain", "synchronized"):
            keras.utils.set_random_seed(0)
            with strategy.scope():
                model = build(keras)
                if variant == "synchronized":
                    synchronize_batchnorm(model)
                model.compile(
                    keras.optimizers.SGD(0.01),
                    keras.losses.SparseCategoricalCrossentropy(
                        from_logits=True
                    ),
                )
            # Warm-up: tracing and the first collectives.
            model.fit(data, steps_per_epoch=2, epochs=1, verbose=0)
            models[variant] = model
        times = {variant: [] for variant in models}
        for _ in range(rounds):
            for variant, model in models.items():
                model.fit(
                    data,
                    steps_per_epoch=steps,
                    epochs=1,
                    verbose=0,
                    callbacks=[_StepTimer(keras, times[variant])],
                )
        plain = statistics.median(times["plain"])
        synced = statistics.median(times["synchronized"])
        print(
            json.dumps(
                {
                    "case": name,
                    "batchnorm_layers": len(batchnorm_layers(models["plain"])),
                    "replicas": strategy.num_replicas_in_sync,
                    "cross_device_ops": type(
                        strategy.extended._cross_device_ops
                    ).__name__,
                    "global_batch": args.batch,
                    "steps": steps,
                    "rounds": rounds,
                    "plain_ms_per_step": round(plain, 2),
                    "synchronized_ms_per_step": round(synced, 2),
                    "ratio": round(synced / plain, 3),
                    "onednn": os.environ.get("TF_ENABLE_ONEDNN_OPTS", "unset"),
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()

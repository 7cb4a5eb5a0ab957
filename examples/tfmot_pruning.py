"""Magnitude pruning (TensorFlow Model Optimization) under MirroredStrategy,
with gradient accumulation, warmup and the monitors: the tf_keras flavour.

TFMOT works on tf_keras (Keras 2) models only, so this script selects that
flavour before anything imports Keras: `TF_USE_LEGACY_KERAS=1`. keras_mgpu
then builds on tf_keras, and `GradientAccumulationOptimizer` is its tf_keras
variant. `PruningStepSync` replaces TFMOT's `UpdatePruningStep`: it makes
the pruning schedule count optimizer *updates*, not micro-batches (TFMOT's
layer counts every forward pass, which accumulation multiplies).

Run:
    python examples/tfmot_pruning.py            # all GPUs (or 2 CPUs)
    python examples/tfmot_pruning.py --quick    # seconds, on CPU
"""

import os

# Before any import of TensorFlow, Keras or keras_mgpu.
os.environ["TF_USE_LEGACY_KERAS"] = "1"
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--quick", action="store_true", help="tiny run")
parser.add_argument("--epochs", type=int, default=None)
parser.add_argument("--cpu-devices", type=int, default=2)
args = parser.parse_args()

# Logical CPU devices can only be set before TensorFlow starts its runtime.
if not tf.config.list_physical_devices("GPU"):
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * args.cpu_devices,
    )

import tensorflow_model_optimization as tfmot  # noqa: E402
import tf_keras as keras  # noqa: E402  (TFMOT needs tf_keras models)

from keras_mgpu.callbacks import (  # noqa: E402
    GPULoadMonitor,
    LearningRateWarmup,
    MemoryMonitor,
    PruningStepSync,
)
from keras_mgpu.optimizers import GradientAccumulationOptimizer  # noqa: E402

PER_REPLICA_BATCH = 32
ACCUMULATION_STEPS = 2
TARGET_SPARSITY = 0.8
EPOCHS = args.epochs or (3 if args.quick else 8)
SAMPLES = 2048 if args.quick else 8192


def make_data(samples, seed=0):
    """Replace with your data. 10 classes, a learnable rule of 32 features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 32)).astype("float32")
    w = np.random.default_rng(1).normal(size=(32, 10)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int32")


devices = [d.name for d in tf.config.list_logical_devices("GPU")] or [
    d.name for d in tf.config.list_logical_devices("CPU")
]
strategy = tf.distribute.MirroredStrategy(devices)
replicas = strategy.num_replicas_in_sync
x, y = make_data(SAMPLES)
x_val, y_val = make_data(1024, seed=1)
step_batch = PER_REPLICA_BATCH * replicas
updates_per_epoch = (len(x) // step_batch) // ACCUMULATION_STEPS
total_updates = EPOCHS * updates_per_epoch

with strategy.scope():
    model = tfmot.sparsity.keras.prune_low_magnitude(
        keras.Sequential(
            [
                keras.layers.Dense(256, activation="relu", input_shape=(32,)),
                keras.layers.Dense(10),
            ]
        ),
        # Steps are optimizer updates, thanks to PruningStepSync.
        pruning_schedule=tfmot.sparsity.keras.PolynomialDecay(
            0.0,
            TARGET_SPARSITY,
            begin_step=0,
            end_step=max(total_updates * 2 // 3, 1),
            frequency=max(updates_per_epoch // 4, 1),
        ),
    )
    model.compile(
        optimizer=GradientAccumulationOptimizer(
            keras.optimizers.Adam(5e-3), ACCUMULATION_STEPS
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

history = model.fit(
    x,
    y,
    batch_size=step_batch,
    epochs=EPOCHS,
    validation_data=(x_val, y_val),
    verbose=2,
    callbacks=[
        PruningStepSync(),  # instead of tfmot's UpdatePruningStep
        LearningRateWarmup(warmup_epochs=1),
        MemoryMonitor(),
        GPULoadMonitor(interval=0.5),
    ],
)

final = tfmot.sparsity.keras.strip_pruning(model)
kernels = [w for w in final.get_weights() if w.ndim == 2]
sparsity = float(np.mean([np.mean(k == 0) for k in kernels]))
logits = final.predict(x_val, verbose=0)
accuracy = float(np.mean(np.argmax(logits, axis=1) == y_val))
print(f"updates: {int(model.optimizer.iterations.numpy())}")
print(f"kernel sparsity after strip_pruning: {sparsity:.3f}")
print(f"final validation accuracy (pruned model): {accuracy:.4f}")

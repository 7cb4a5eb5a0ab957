"""Multi-GPU training with `model.fit` and every keras_mgpu component.

MirroredStrategy over the GPUs present (or, without GPUs, over logical CPU
devices, so the script runs anywhere), with:

- gradient accumulation (`GradientAccumulationOptimizer`): 4 micro-batches
  per update, so the update sees 4x the batch that fits in memory;
- linear learning-rate scaling and warmup (`LearningRateScaler`,
  `LearningRateWarmup`), from the global batch actually in use;
- memory and load monitors (`MemoryMonitor`, `GPULoadMonitor`), whose
  figures land in the logs, the CSV file and the PNG report;
- a recomputed block (`RecomputeGrad`): its activations are recomputed in
  the backward pass instead of stored. Its Dropout draws the same mask in
  the recomputation.

Run:
    python examples/mirrored_training.py             # all GPUs (or 2 CPUs)
    python examples/mirrored_training.py --quick     # seconds, on CPU
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--quick", action="store_true", help="tiny run")
parser.add_argument("--epochs", type=int, default=None)
parser.add_argument("--cpu-devices", type=int, default=2)
parser.add_argument("--output", default="mirrored_training_run")
args = parser.parse_args()

# Devices first: logical CPU devices (and GPU memory growth) can only be set
# before TensorFlow starts its runtime.
gpus = tf.config.list_physical_devices("GPU")
if gpus:
    for gpu in gpus:
        tf.config.experimental.set_memory_growth(gpu, True)
else:
    tf.config.set_logical_device_configuration(
        tf.config.list_physical_devices("CPU")[0],
        [tf.config.LogicalDeviceConfiguration()] * args.cpu_devices,
    )

import keras  # noqa: E402  (Keras 3)

import keras_mgpu  # noqa: E402
from keras_mgpu.callbacks import (  # noqa: E402
    GPULoadMonitor,
    LearningRateScaler,
    LearningRateWarmup,
    MemoryMonitor,
)
from keras_mgpu.layers import RecomputeGrad  # noqa: E402

PER_REPLICA_BATCH = 32  # what fits in one device's memory
ACCUMULATION_STEPS = 4  # micro-batches per update
BASE_LEARNING_RATE = 1e-3  # tuned for...
BASE_BATCH_SIZE = 32  # ...this batch
EPOCHS = args.epochs or (2 if args.quick else 6)
SAMPLES = 2048 if args.quick else 8192


def make_data(samples, seed=0):
    """Replace with your data. 10 classes, a learnable rule of 32 features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 32)).astype("float32")
    w = np.random.default_rng(1).normal(size=(32, 10)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int32")


def build_model():
    inputs = keras.Input((32,))
    x = keras.layers.Dense(128, activation="relu")(inputs)
    # A residual MLP block; wrapped, its inner activations are recomputed.
    block = keras.Sequential(
        [
            keras.layers.Dense(512, activation="gelu"),
            keras.layers.Dropout(0.1),
            keras.layers.Dense(128),
        ],
        name="mlp_block",
    )
    x = keras.layers.Add()([x, RecomputeGrad(block)(x)])
    outputs = keras.layers.Dense(10)(x)
    return keras.Model(inputs, outputs)


devices = [d.name for d in tf.config.list_logical_devices("GPU")] or [
    d.name for d in tf.config.list_logical_devices("CPU")
]
strategy = tf.distribute.MirroredStrategy(devices)
print(f"{strategy.num_replicas_in_sync} replicas: {devices}")

x, y = make_data(SAMPLES)
x_val, y_val = make_data(1024, seed=1)
with strategy.scope():
    model = build_model()
    model.compile(
        optimizer=keras_mgpu.GradientAccumulationOptimizer(
            keras.optimizers.Adam(BASE_LEARNING_RATE), ACCUMULATION_STEPS
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    global_batch = keras_mgpu.global_batch_size(
        PER_REPLICA_BATCH, accumulation_steps=model.optimizer
    )
print(
    f"global batch {global_batch} = {PER_REPLICA_BATCH} per replica x "
    f"{strategy.num_replicas_in_sync} replicas x {ACCUMULATION_STEPS} steps"
)

os.makedirs(args.output, exist_ok=True)
csv_path = os.path.join(args.output, "history.csv")
history = model.fit(
    x,
    y,
    # fit's batch is one micro-step of all replicas together.
    batch_size=PER_REPLICA_BATCH * strategy.num_replicas_in_sync,
    epochs=EPOCHS,
    validation_data=(x_val, y_val),
    verbose=2,
    callbacks=[
        # The scaler first: the warmup then ramps to the scaled rate.
        LearningRateScaler(
            base_batch_size=BASE_BATCH_SIZE,
            per_replica_batch_size=PER_REPLICA_BATCH,
        ),
        LearningRateWarmup(warmup_epochs=1),
        MemoryMonitor(),
        GPULoadMonitor(interval=0.5),
        # Last, so it records what the callbacks above logged.
        keras.callbacks.CSVLogger(csv_path),
    ],
)

accuracy = history.history["val_accuracy"][-1]
print(f"updates: {int(model.optimizer.iterations.numpy())}")
print(f"final learning rate: {history.history['learning_rate'][-1]:.4g}")
print(f"final validation accuracy: {accuracy:.4f}")
try:
    from keras_mgpu.report import plot_training_report

    print("report:", plot_training_report(csv_path, csv_path[:-4] + ".png"))
except ImportError as exc:  # matplotlib is optional
    print(f"no report: {exc}")

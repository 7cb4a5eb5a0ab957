"""Reach a target global batch with the largest micro-batch that fits.

`keras_mgpu.configure_batch` measures, on a copy of your model, how much
memory a training step takes per sample (TensorFlow's allocator peaks of
real steps), finds the largest per-replica batch that fits the device's
memory budget, and splits the target global batch exactly into
`per replica x replicas x accumulation steps`. It returns the optimizer to
compile with (wrapped in `GradientAccumulationOptimizer` when accumulation
is needed), the batch to give `fit` and the `LearningRateScaler` for the
learning rate tuned at `base_batch_size`; `setup.explanation` says what it
measured and decided.

On a GPU the budget defaults to 90% of its memory. On CPU (no GPU here, or
`--quick`) TensorFlow keeps allocator statistics only with oneDNN on, set
below before TensorFlow starts, and the script gives a small budget
(`--budget-mb`) so that accumulation is needed.

Run:
    python examples/batch_size_by_memory.py            # all GPUs (or 2 CPUs)
    python examples/batch_size_by_memory.py --quick    # seconds, on CPU
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# CPU allocator statistics exist only with oneDNN on, which some CPUs do
# not turn on by default; it must be set before TensorFlow starts.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--quick", action="store_true", help="tiny run")
parser.add_argument("--epochs", type=int, default=None)
parser.add_argument("--cpu-devices", type=int, default=2)
parser.add_argument(
    "--budget-mb",
    type=float,
    default=None,
    help="memory per replica (default: 90%% of a GPU; 12 MB on CPU)",
)
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
from keras_mgpu.callbacks import LearningRateWarmup  # noqa: E402

GLOBAL_BATCH = 2048 if args.quick else 16384  # what the recipe asks for
BASE_BATCH = 256  # the batch its learning rate was tuned for
BASE_LEARNING_RATE = 1e-3
SAMPLES = 4096 if args.quick else 131072
WIDTH = 256 if args.quick else 2048
EPOCHS = args.epochs or (2 if args.quick else 5)
budget_mb = args.budget_mb
if budget_mb is None and not gpus:
    budget_mb = 12.0  # small, so that the CPU run needs accumulation


def make_data(samples, seed=0):
    """Replace with your data. 10 classes, a learnable rule of 64 features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 64)).astype("float32")
    w = np.random.default_rng(1).normal(size=(64, 10)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int32")


devices = [d.name for d in tf.config.list_logical_devices("GPU")] or [
    d.name for d in tf.config.list_logical_devices("CPU")
]
strategy = tf.distribute.MirroredStrategy(devices)
print(f"{strategy.num_replicas_in_sync} replicas: {devices}")

x, y = make_data(SAMPLES)
loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
with strategy.scope():
    model = keras.Sequential(
        [keras.Input((64,))]
        + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(6)]
        + [keras.layers.Dense(10)]
    )
    model.compile(keras.optimizers.Adam(BASE_LEARNING_RATE), loss=loss)

setup = keras_mgpu.configure_batch(
    model,
    (x, y),
    global_batch_size=GLOBAL_BATCH,
    base_batch_size=BASE_BATCH,
    memory_budget_mb=budget_mb,  # None on a GPU: 90% of its memory
    verbose=0,  # printed below
)
print(f"decision: {setup.explanation}")
print(
    f"global batch {setup.global_batch_size} = "
    f"{setup.per_replica_batch_size} per replica x {setup.num_replicas} "
    f"replicas x {setup.accumulation_steps} accumulation steps"
)
print(f"optimizer: {type(setup.optimizer).__name__}")
print(
    f"learning rate: {setup.base_learning_rate:.4g} -> "
    f"{setup.learning_rate:.4g}"
)

with strategy.scope():
    model.compile(optimizer=setup.optimizer, loss=loss)
history = model.fit(
    x,
    y,
    batch_size=setup.step_batch_size,  # per replica x replicas
    epochs=EPOCHS,
    verbose=2,
    # The scaler first, then the warmup ramps to the scaled rate.
    callbacks=setup.callbacks + [LearningRateWarmup(warmup_epochs=1)],
)
print(f"updates: {int(model.optimizer.iterations.numpy())}")
print(f"final learning rate: {history.history['learning_rate'][-1]:.4g}")
print(f"final loss: {history.history['loss'][-1]:.4f}")

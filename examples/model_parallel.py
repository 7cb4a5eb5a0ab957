"""A model too large for one device: stages on several, pipelined.

`keras_mgpu.apply_placement` cuts a Sequential or functional Keras 3 model
into contiguous stages, one per device, balanced by parameter bytes: each
stage's weights, optimizer state, forward and backward passes live on its
device, and only the activations at the cuts (and their gradients) cross
between devices. `micro_batches=M` pipelines the stages (GPipe): each batch
is cut into M micro-batches inside the step, so stage 2 works on one
micro-batch while stage 1 works on the next. Training is plain `model.fit`
under the default strategy (no `strategy.scope()`: this is model
parallelism, not data parallelism), and the result equals the unplaced
model's training.

Without GPUs the stages go to logical CPU devices: they share the host's
cores and memory, so there is no speed-up; the script then shows the
mechanics only.

Run:
    python examples/model_parallel.py             # all GPUs (or 2 CPUs)
    python examples/model_parallel.py --quick     # seconds, on CPU
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
parser.add_argument("--micro-batches", type=int, default=4)
parser.add_argument("--output", default="model_parallel_run")
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

EPOCHS = args.epochs or (2 if args.quick else 5)
SAMPLES = 2048 if args.quick else 65536
WIDTH = 128 if args.quick else 4096
DEPTH = 4 if args.quick else 12
BATCH = 128 if args.quick else 512


def make_data(samples, seed=0):
    """Replace with your data. 10 classes, a learnable rule of 64 features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 64)).astype("float32")
    w = np.random.default_rng(1).normal(size=(64, 10)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int32")


def build_model():
    """Any Sequential or functional model; built (it has an Input)."""
    inputs = keras.Input((64,))
    x = keras.layers.Dense(WIDTH, activation="relu", name="stem")(inputs)
    for i in range(DEPTH):
        h = keras.layers.Dense(WIDTH, activation="gelu", name=f"block_{i}")(x)
        x = keras.layers.Add(name=f"residual_{i}")([x, h])
    outputs = keras.layers.Dense(10, name="head")(x)
    return keras.Model(inputs, outputs, name="deep_mlp")


devices = [d.name for d in tf.config.list_logical_devices("GPU")] or [
    d.name for d in tf.config.list_logical_devices("CPU")
]
keras.utils.set_random_seed(0)
model = build_model()
# A copy with the same weights, cut into len(devices) stages.
placed = keras_mgpu.apply_placement(
    model, devices, micro_batches=args.micro_batches
)
placed.compile(
    optimizer=keras.optimizers.Adam(1e-3),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
x, y = make_data(SAMPLES)
x_val, y_val = make_data(1024, seed=1)
history = placed.fit(
    x,
    y,
    batch_size=BATCH,  # cut into --micro-batches inside each step
    epochs=EPOCHS,
    validation_data=(x_val, y_val),
    verbose=2,
)

# Per device: its layers, parameters, optimizer state (and the GPU peak).
rows = keras_mgpu.placement_report(placed)
for row in rows:
    if row["stage"] is not None:
        print(
            f"stage {row['stage']} on {row['device']}: "
            f"{len(row['layers'])} layers, {row['params']} parameters"
        )
print(f"parameters: {model.count_params()}")
print(f"micro-batches per step: {args.micro_batches}")
print(f"final loss: {history.history['loss'][-1]:.4f}")
print(f"final validation accuracy: {history.history['val_accuracy'][-1]:.4f}")

os.makedirs(args.output, exist_ok=True)
path = os.path.join(args.output, "placed.keras")
placed.save(path)  # the placement is saved with the model
plain = keras_mgpu.strip_placement(placed)  # the same weights, one device
print(f"saved: {path}; unplaced copy: {plain.count_params()} parameters")

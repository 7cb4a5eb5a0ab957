"""A custom training loop with `GradientAccumulationOptimizer` under
MirroredStrategy.

When you write the loop yourself (`strategy.run`, `GradientTape`), the
wrapper is used exactly like any Keras optimizer: call `apply` on every
micro-batch; it accumulates on each replica and updates the weights once
every `accumulation_steps` calls, with the mean gradient, all-reduced once.
Callbacks do not run in a custom loop, so the learning rate is a
`keras_mgpu.schedules.Warmup` schedule around the linearly scaled rate; it
advances with the *updates* (`optimizer.iterations`), not the micro-steps.
A `RecomputeGrad` block trains as it would in `fit`.

Run:
    python examples/custom_training_loop.py            # all GPUs (or 2 CPUs)
    python examples/custom_training_loop.py --quick    # seconds, on CPU
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

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

import keras  # noqa: E402  (Keras 3)

import keras_mgpu  # noqa: E402
from keras_mgpu.layers import RecomputeGrad  # noqa: E402
from keras_mgpu.schedules import Warmup, scaled_learning_rate  # noqa: E402

PER_REPLICA_BATCH = 32
ACCUMULATION_STEPS = 4
BASE_LEARNING_RATE = 1e-3
BASE_BATCH_SIZE = 32
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
    block = keras.Sequential(
        [keras.layers.Dense(512, activation="gelu"), keras.layers.Dense(128)],
        name="mlp_block",
    )
    x = keras.layers.Add()([x, RecomputeGrad(block)(x)])
    return keras.Model(inputs, keras.layers.Dense(10)(x))


devices = [d.name for d in tf.config.list_logical_devices("GPU")] or [
    d.name for d in tf.config.list_logical_devices("CPU")
]
strategy = tf.distribute.MirroredStrategy(devices)
replicas = strategy.num_replicas_in_sync

x, y = make_data(SAMPLES)
x_val, y_val = make_data(1024, seed=1)
micro_batch = PER_REPLICA_BATCH * replicas  # one micro-step, all replicas
steps_per_epoch = len(x) // micro_batch
# Whole micro-batches only: each replica gets PER_REPLICA_BATCH examples.
dataset = (
    tf.data.Dataset.from_tensor_slices((x, y))
    .shuffle(len(x), seed=0)
    .batch(micro_batch, drop_remainder=True)
)
distributed = strategy.experimental_distribute_dataset(dataset)

with strategy.scope():
    model = build_model()
    global_batch = keras_mgpu.global_batch_size(
        PER_REPLICA_BATCH, accumulation_steps=ACCUMULATION_STEPS
    )
    learning_rate = Warmup(
        scaled_learning_rate(BASE_LEARNING_RATE, global_batch, BASE_BATCH_SIZE),
        warmup_steps=steps_per_epoch // ACCUMULATION_STEPS,  # one epoch
    )
    optimizer = keras_mgpu.GradientAccumulationOptimizer(
        keras.optimizers.Adam(learning_rate), ACCUMULATION_STEPS
    )
    # Create the optimizer's variables (accumulators, Adam moments) now,
    # under the strategy: not lazily inside the traced train step.
    optimizer.build(model.trainable_variables)
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def train_step(batch):
    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            # Under a strategy, Keras 3 losses divide by the replicas in
            # sync, so the replicas' gradients sum to the global mean.
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        # Accumulates; every ACCUMULATION_STEPS-th call updates the weights.
        optimizer.apply(grads, model.trainable_variables)
        return loss

    losses = strategy.run(replica_step, args=batch)
    return strategy.reduce("SUM", losses, axis=None)


print(
    f"{replicas} replicas, global batch {global_batch} = "
    f"{PER_REPLICA_BATCH} x {replicas} x {ACCUMULATION_STEPS} accumulation"
)
for epoch in range(EPOCHS):
    start, total = time.perf_counter(), 0.0
    for batch in distributed:
        total += float(train_step(batch))
    logits = model.predict(x_val, batch_size=256, verbose=0)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_val))
    print(
        f"epoch {epoch + 1}/{EPOCHS}: loss {total / steps_per_epoch:.4f}, "
        f"validation accuracy {accuracy:.4f}, learning rate "
        f"{float(np.asarray(optimizer.learning_rate)):.4g}, "
        f"{time.perf_counter() - start:.1f}s"
    )

print(
    f"micro-steps: {int(optimizer.micro_steps.numpy())}, updates "
    f"(optimizer.iterations): {int(optimizer.iterations.numpy())}"
)
print(f"final validation accuracy: {accuracy:.4f}")

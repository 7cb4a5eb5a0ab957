"""Device memory and load in TensorBoard, next to the loss.

`MemoryMonitor` and `GPULoadMonitor` put their figures into the epoch
`logs` (`mem/...`, and `gpu/...` with NVML, else `cpu/...`), so Keras's own
`TensorBoard` and `CSVLogger` record them with no extra wiring: list the
monitors **before** the writers. After training, the script reads the
TensorBoard event files back and prints the scalar tags they hold, so you
know what to look for in `tensorboard --logdir <output>/logs` (one panel
group per prefix).

(`StragglerMonitor`, the third monitor, needs a multi-worker cluster: see
examples/multi_worker.py.)

Run:
    python examples/tensorboard_monitoring.py           # all GPUs (or 2 CPUs)
    python examples/tensorboard_monitoring.py --quick   # seconds, on CPU
    tensorboard --logdir tensorboard_monitoring_run/logs
"""

import argparse
import glob
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# TensorFlow's CPU allocator keeps statistics (mem/host_tf_*) only with
# oneDNN on, which some CPUs do not turn on by default; set before TF starts.
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--quick", action="store_true", help="tiny run")
parser.add_argument("--epochs", type=int, default=None)
parser.add_argument("--cpu-devices", type=int, default=2)
parser.add_argument("--output", default="tensorboard_monitoring_run")
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

from keras_mgpu.callbacks import GPULoadMonitor, MemoryMonitor  # noqa: E402

EPOCHS = args.epochs or (2 if args.quick else 10)
SAMPLES = 2048 if args.quick else 60000
WIDTH = 128 if args.quick else 1024
PER_REPLICA_BATCH = 64


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
with strategy.scope():
    model = keras.Sequential(
        [keras.Input((64,))]
        + [keras.layers.Dense(WIDTH, activation="relu") for _ in range(3)]
        + [keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

log_dir = os.path.join(args.output, "logs")
csv_path = os.path.join(args.output, "history.csv")
os.makedirs(args.output, exist_ok=True)
model.fit(
    x,
    y,
    batch_size=PER_REPLICA_BATCH * strategy.num_replicas_in_sync,
    epochs=EPOCHS,
    validation_split=0.1,
    verbose=2,
    callbacks=[
        # Monitors first: they write their figures into `logs`...
        MemoryMonitor(),
        GPULoadMonitor(interval=0.25 if args.quick else 1.0),
        # ...which the writers then record.
        keras.callbacks.TensorBoard(log_dir),
        keras.callbacks.CSVLogger(csv_path),
    ],
)


def scalar_tags(directory):
    """{tag: last value} of every scalar in the event files under it.

    Keras 3 writes scalars as tensor summaries named `epoch_<key>`.
    """
    found = {}
    pattern = os.path.join(directory, "**", "events.out.tfevents.*")
    for path in sorted(glob.glob(pattern, recursive=True)):
        run = os.path.relpath(os.path.dirname(path), directory)
        for record in tf.data.TFRecordDataset(path):
            event = tf.compat.v1.Event.FromString(record.numpy())
            for value in event.summary.value:
                # Skip the model's config and graph (text, not scalars).
                if value.metadata.plugin_data.plugin_name != "scalars":
                    continue
                number = tf.make_ndarray(value.tensor)
                found[f"{run}: {value.tag}"] = float(number)
    return found


tags = scalar_tags(log_dir)
print(f"TensorBoard scalars in {log_dir}:")
for tag, value in sorted(tags.items()):
    print(f"  {tag} = {value:.4g}")
with open(csv_path) as f:
    columns = f.readline().strip().split(",")
monitor_columns = [c for c in columns if c.startswith(("mem/", "gpu/", "cpu/"))]
print(f"CSV columns from the monitors: {len(monitor_columns)}")
print(f"tensorboard --logdir {log_dir}")

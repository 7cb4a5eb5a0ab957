"""Fine-tuning a keras-hub BERT classifier on several devices, on Keras 3
with TensorFlow or with JAX.

A `keras_hub.models.BertBackbone` inside a user classifier, trained with
`model.fit` on every GPU (or 2 CPU devices without one): under
`tf.distribute.MirroredStrategy` on TensorFlow, under
`keras.distribution.DataParallel` on JAX (`KERAS_BACKEND=jax`), with:

- in-place recompute (`keras_mgpu.apply_recompute`): every
  `TransformerEncoder` layer of the backbone recomputes its activations in
  the backward pass instead of storing them (`tf.recompute_grad` /
  `jax.checkpoint`, Dropout masks identical). The model stays a
  `BertBackbone` inside your classifier (config, weights and seeds kept);
- gradient accumulation (`GradientAccumulationOptimizer`): 4 micro-batches
  per update, the schedule and `iterations` counted in updates;
- learning-rate warmup (`LearningRateWarmup`) over the first updates, as
  BERT fine-tuning recipes do;
- `MemoryMonitor`: device memory in the logs (the host's on CPU);
- `ThroughputMonitor`: samples/s, tokens/s, TFLOP/s per device and MFU.

By default the backbone is built from a configuration with random weights
(no download): the data below is synthetic, so the run shows the mechanics,
not BERT's accuracy. With `--preset bert_base_en_uncased` (any keras-hub
BERT preset) the pretrained weights are downloaded by keras-hub and used
instead.

Run:
    python examples/fine_tune_keras_hub.py            # all GPUs (or 2 CPUs)
    python examples/fine_tune_keras_hub.py --quick    # seconds, on CPU
    KERAS_BACKEND=jax python examples/fine_tune_keras_hub.py --quick

Needs keras-hub: `pip install "keras-mgpu[hub]"` (and `[jax]` for JAX).
"""

import argparse
import contextlib
import os

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--quick", action="store_true", help="tiny run")
parser.add_argument("--epochs", type=int, default=None)
parser.add_argument("--cpu-devices", type=int, default=2)
parser.add_argument(
    "--preset", default=None, help="a keras-hub BERT preset (downloads)"
)
args = parser.parse_args()
BACKEND = os.environ.setdefault("KERAS_BACKEND", "tensorflow")

# Devices first, before the backend starts: CPU devices (used only without a
# GPU) and GPU memory taken as needed, so MemoryMonitor's figures mean
# something.
if BACKEND == "jax":
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count={args.cpu_devices}"
    )
else:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import tensorflow as tf

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
import keras_hub  # noqa: E402
import numpy as np  # noqa: E402

import keras_mgpu  # noqa: E402
from keras_mgpu.callbacks import (  # noqa: E402
    LearningRateWarmup,
    MemoryMonitor,
    ThroughputMonitor,
)

if args.quick:  # a toy BERT, to see every piece work in seconds
    SIZES = dict(
        vocabulary_size=64,
        num_layers=2,
        num_heads=2,
        hidden_dim=32,
        intermediate_dim=64,
        max_sequence_length=16,
    )
    SEQUENCE_LENGTH, SAMPLES, PER_REPLICA_BATCH = 16, 256, 8
else:  # BERT-small sized; real fine-tuning starts from a preset
    SIZES = dict(
        vocabulary_size=30522,
        num_layers=4,
        num_heads=8,
        hidden_dim=512,
        intermediate_dim=2048,
        max_sequence_length=128,
    )
    SEQUENCE_LENGTH, SAMPLES, PER_REPLICA_BATCH = 128, 8192, 16
VOCABULARY = SIZES["vocabulary_size"]
ACCUMULATION_STEPS = 4  # micro-batches per update
LEARNING_RATE = 1e-3 if args.quick else 5e-5
EPOCHS = args.epochs or (2 if args.quick else 3)
NUM_CLASSES = 2


def make_data(samples, seed=0):
    """Replace with your tokenized data (keras_hub.models.BertTokenizer).

    Synthetic sentences of random length; the label says whether the
    "marker" token 5 occurs in the sentence.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(SEQUENCE_LENGTH // 2, SEQUENCE_LENGTH + 1, samples)
    padding = np.arange(SEQUENCE_LENGTH)[None, :] < lengths[:, None]
    tokens = rng.integers(6, VOCABULARY, (samples, SEQUENCE_LENGTH))
    labels = rng.integers(0, NUM_CLASSES, samples)
    where = rng.integers(1, SEQUENCE_LENGTH // 2, samples)
    tokens[labels == 1, where[labels == 1]] = 5
    tokens[:, 0] = 2  # [CLS]
    features = {
        "token_ids": (tokens * padding).astype("int32"),
        "segment_ids": np.zeros_like(tokens, dtype="int32"),
        "padding_mask": padding.astype("int32"),
    }
    return features, labels.astype("int32")


def build_classifier():
    """Your classifier around a keras-hub backbone."""
    if args.preset:
        backbone = keras_hub.models.BertBackbone.from_preset(args.preset)
    else:
        backbone = keras_hub.models.BertBackbone(**SIZES, dropout=0.1)
    inputs = {
        name: keras.Input((None,), dtype="int32", name=name)
        for name in ("token_ids", "segment_ids", "padding_mask")
    }
    pooled = backbone(inputs)["pooled_output"]
    pooled = keras.layers.Dropout(0.1)(pooled)
    outputs = keras.layers.Dense(NUM_CLASSES, name="head")(pooled)
    return keras.Model(inputs, outputs, name="classifier")


# Every GPU, else the CPU devices set up above. Both a strategy and a
# distribution lay variables out when they are created: build (and compile)
# inside their scope.
if BACKEND == "jax":
    devices = keras.distribution.list_devices()
    # Several devices: DataParallel. One device (one GPU): no distribution,
    # since Keras 3.15's DataParallel over a single device compiles the
    # train step again at the second step and at every epoch's first one
    # (tests/test_keras_limits.py), seconds of a BERT compile inside
    # each epoch.
    scope = (
        keras.distribution.DataParallel(devices=devices)
        if len(devices) > 1
        else None
    )
else:
    devices = [d.name for d in tf.config.list_logical_devices("GPU")] or [
        d.name for d in tf.config.list_logical_devices("CPU")
    ]
    scope = tf.distribute.MirroredStrategy(devices)
replicas = keras_mgpu.num_replicas_in_sync(scope)


def in_scope():
    """The strategy's or distribution's scope (nothing on one JAX device)."""
    return scope.scope() if scope is not None else contextlib.nullcontext()


print(f"backend: {keras.backend.backend()}")
print(f"{replicas} replicas: {devices}")

keras.utils.set_random_seed(0)
x, y = make_data(SAMPLES)
x_val, y_val = make_data(SAMPLES // 4, seed=1)
with in_scope():
    model = build_classifier()
    # In place: the encoder layers inside the backbone are switched to
    # recompute; `model` and its BertBackbone stay the same objects.
    keras_mgpu.apply_recompute(model, keras_hub.layers.TransformerEncoder)
    model.compile(
        optimizer=keras_mgpu.GradientAccumulationOptimizer(
            keras.optimizers.AdamW(LEARNING_RATE, weight_decay=0.01),
            ACCUMULATION_STEPS,
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
recomputed = keras_mgpu.recomputed_layers(model)
backbone_class = next(
    type(layer).__name__
    for layer in model.layers
    if isinstance(layer, keras_hub.models.Backbone)
)
print(
    f"recomputed layers: {len(recomputed)} "
    f"({', '.join(layer.name for layer in recomputed)}) in "
    f"the {backbone_class} of model {model.name!r}"
)
global_batch = PER_REPLICA_BATCH * replicas * ACCUMULATION_STEPS
print(
    f"global batch {global_batch} = {PER_REPLICA_BATCH} per replica x "
    f"{replicas} replicas x {ACCUMULATION_STEPS} steps"
)
updates_per_epoch = SAMPLES // (PER_REPLICA_BATCH * replicas)
updates_per_epoch //= ACCUMULATION_STEPS
with in_scope():
    history = model.fit(
        x,
        y,
        batch_size=PER_REPLICA_BATCH * replicas,  # one micro-step, all replicas
        epochs=EPOCHS,
        # --quick skips validation: one trace less (tracing BERT dominates).
        validation_data=None if args.quick else (x_val, y_val),
        verbose=2,
        callbacks=[
            # Warm up over 10% of the updates (counted in optimizer
            # updates, not micro-steps).
            LearningRateWarmup(
                warmup_steps=max(1, EPOCHS * updates_per_epoch // 10)
            ),
            MemoryMonitor(),
            # Samples and tokens per second, TFLOP/s per device and MFU
            # (on a GPU the table knows), compile time left out.
            ThroughputMonitor(token_input="token_ids", window_size=50),
        ],
    )
print(f"updates: {int(keras.ops.convert_to_numpy(model.optimizer.iterations))}")
print(f"first epoch loss: {history.history['loss'][0]:.4f}")
print(f"final loss: {history.history['loss'][-1]:.4f}")
memory_keys = sorted(k for k in history.history if "mem" in k)
print(f"memory keys: {', '.join(memory_keys)}")
perf = {k: v[-1] for k, v in history.history.items() if k.startswith("perf/")}
print(
    f"last epoch: {perf['perf/samples_per_sec']:.1f} samples/s, "
    f"{perf['perf/tokens_per_sec']:.0f} tokens/s, "
    f"{perf['perf/tflops_per_device']:.4f} TFLOP/s per device, "
    f"MFU {perf['perf/mfu']:.3f} (NaN without a known peak), "
    f"compile {perf['perf/compile_seconds']:.1f} s in "
    f"{perf['perf/compile_count']:.0f} compilation(s)"
)
if "val_accuracy" in history.history:
    accuracy = history.history["val_accuracy"][-1]
    print(f"final validation accuracy: {accuracy:.4f}")

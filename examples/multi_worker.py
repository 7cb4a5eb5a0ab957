"""Multi-worker training: MultiWorkerMirroredStrategy, a custom training
loop, `GradientAccumulationOptimizer`.

Every worker is a process with its own `TF_CONFIG` (the cluster, and which
task it is). Run without `TF_CONFIG`, this script launches a 2-worker
cluster on 127.0.0.1 itself and prints each worker's `TF_CONFIG`: the same
you would set on each machine of a real cluster (with their addresses) and
run `python multi_worker.py` there.

Keras 3's `model.fit` fails under MultiWorkerMirroredStrategy
(keras-team/keras#20585), so the loop is written out: `strategy.run`, a
`GradientTape`, and the accumulating optimizer's `apply` on each
micro-batch (it updates every `ACCUMULATION_STEPS` calls, all-reducing the
accumulated gradient across every replica of every worker once). Under the
tf_keras flavour (`TF_USE_LEGACY_KERAS=1`) `model.fit` itself works here.

Run:
    python examples/multi_worker.py            # launches 2 local workers
    python examples/multi_worker.py --quick    # seconds
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--quick", action="store_true", help="tiny run")
parser.add_argument("--epochs", type=int, default=None)
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--timeout", type=float, default=600.0)
args = parser.parse_args()

PER_REPLICA_BATCH = 32
ACCUMULATION_STEPS = 2
BASE_LEARNING_RATE = 1e-3
BASE_BATCH_SIZE = 32
EPOCHS = args.epochs or (2 if args.quick else 6)
SAMPLES = 2048 if args.quick else 8192


# ----------------------------------------------------------------------
# Launcher: no TF_CONFIG, so start a local cluster of worker processes.
# ----------------------------------------------------------------------
def free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def relay(stream, prefix):
    for line in stream:
        print(f"{prefix} {line}", end="", flush=True)


def launch_local_cluster():
    cluster = {"worker": [f"127.0.0.1:{p}" for p in free_ports(args.workers)]}
    procs, logs, threads = [], [], []
    for index in range(args.workers):
        tf_config = {
            "cluster": cluster,
            "task": {"type": "worker", "index": index},
        }
        print(f"worker {index}: TF_CONFIG='{json.dumps(tf_config)}'")
        log = tempfile.TemporaryFile(mode="w+")  # TensorFlow's stderr
        proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), *sys.argv[1:]],
            env={**os.environ, "TF_CONFIG": json.dumps(tf_config)},
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
            start_new_session=True,
        )
        thread = threading.Thread(
            target=relay, args=(proc.stdout, f"[worker {index}]"), daemon=True
        )
        thread.start()
        procs.append(proc)
        logs.append(log)
        threads.append(thread)
    deadline = time.monotonic() + args.timeout
    failed = False
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 1))
            failed = failed or proc.returncode != 0
    except subprocess.TimeoutExpired:
        print(f"timed out after {args.timeout:.0f}s", file=sys.stderr)
        failed = True
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        for thread in threads:
            thread.join(timeout=5)
    for index, (proc, log) in enumerate(zip(procs, logs, strict=True)):
        if proc.returncode != 0:
            log.seek(0)
            tail = log.read()[-3000:]
            print(
                f"--- worker {index} stderr (end) ---\n{tail}", file=sys.stderr
            )
    return 1 if failed else 0


if "TF_CONFIG" not in os.environ:
    sys.exit(launch_local_cluster())

# ----------------------------------------------------------------------
# Worker: TF_CONFIG is set. The strategy comes first, before any other
# TensorFlow call, so the collective runtime can start.
# ----------------------------------------------------------------------
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()

import keras_mgpu  # noqa: E402
from keras_mgpu._flavour import keras  # noqa: E402
from keras_mgpu.distribute import worker_info  # noqa: E402
from keras_mgpu.schedules import Warmup, scaled_learning_rate  # noqa: E402

info = worker_info(strategy)
replicas = strategy.num_replicas_in_sync  # every worker's replicas


def make_data(samples, seed=0):
    """Replace with your data. 10 classes, a learnable rule of 32 features."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(samples, 32)).astype("float32")
    w = np.random.default_rng(1).normal(size=(32, 10)).astype("float32")
    return x, np.argmax(x @ w, axis=1).astype("int32")


x, y = make_data(SAMPLES)
x_val, y_val = make_data(1024, seed=1)
micro_batch = PER_REPLICA_BATCH * replicas  # one micro-step, whole cluster
steps_per_epoch = len(x) // micro_batch


def dataset_fn(context):
    # Each worker reads its own shard and batches for its own replicas.
    batch = context.get_per_replica_batch_size(micro_batch)
    return (
        tf.data.Dataset.from_tensor_slices((x, y))
        .shard(context.num_input_pipelines, context.input_pipeline_id)
        .shuffle(len(x), seed=0)
        .batch(batch, drop_remainder=True)
        .take(steps_per_epoch)  # the same number of steps on every worker
    )


distributed = strategy.distribute_datasets_from_function(dataset_fn)

with strategy.scope():
    keras.utils.set_random_seed(0)  # the same initial weights everywhere
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    global_batch = keras_mgpu.global_batch_size(
        PER_REPLICA_BATCH, accumulation_steps=ACCUMULATION_STEPS
    )
    optimizer = keras_mgpu.GradientAccumulationOptimizer(
        keras.optimizers.Adam(
            Warmup(
                scaled_learning_rate(
                    BASE_LEARNING_RATE, global_batch, BASE_BATCH_SIZE
                ),
                warmup_steps=steps_per_epoch // ACCUMULATION_STEPS,
            )
        ),
        ACCUMULATION_STEPS,
    )
    optimizer.build(model.trainable_variables)  # not inside the tf.function
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@tf.function
def train_step(batch):
    def replica_step(xb, yb):
        with tf.GradientTape() as tape:
            # Keras 3 losses divide by the replicas in sync under a
            # strategy: the replicas' gradients sum to the global mean.
            loss = loss_fn(yb, model(xb, training=True))
        grads = tape.gradient(loss, model.trainable_variables)
        optimizer.apply(grads, model.trainable_variables)
        return loss

    losses = strategy.run(replica_step, args=batch)
    return strategy.reduce("SUM", losses, axis=None)


print(
    f"task {info['task_id']} of {info['num_workers']} workers"
    f"{' (chief)' if info['is_chief'] else ''}: {replicas} replicas, "
    f"global batch {global_batch} = {PER_REPLICA_BATCH} x {replicas} x "
    f"{ACCUMULATION_STEPS} accumulation",
    flush=True,
)
for epoch in range(EPOCHS):
    total = 0.0
    for batch in distributed:
        total += float(train_step(batch))
    # Every worker holds the same weights: evaluate locally.
    logits = model(x_val, training=False)
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_val))
    if info["is_chief"]:
        print(
            f"epoch {epoch + 1}/{EPOCHS}: loss {total / steps_per_epoch:.4f}, "
            f"validation accuracy {accuracy:.4f}",
            flush=True,
        )

print(
    f"updates: {int(optimizer.iterations.numpy())}, final validation "
    f"accuracy: {accuracy:.4f}",
    flush=True,
)

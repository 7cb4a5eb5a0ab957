"""Multi-worker training: Keras 3 `model.fit` under
MultiWorkerMirroredStrategy with every keras_mgpu component, surviving a
lost worker.

Every worker is a process with its own `TF_CONFIG` (the cluster, and which
task it is). Run without `TF_CONFIG`, this script launches a 2-worker
cluster on 127.0.0.1 itself and prints each worker's `TF_CONFIG`: on a real
cluster, set the same on each machine (with their addresses, e.g. from your
scheduler) and run `python multi_worker.py --backup-dir /shared/dir` there.

Keras 3's own `model.fit` fails under MultiWorkerMirroredStrategy
(keras-team/keras#20585); one line, `enable_multi_worker_fit()`, fixes it.
`BackupAndRestore` (keras_mgpu's: multi-worker safe) keeps the chief's
backup on storage every worker reaches; `WorkerWatchdog` makes the others
fail within its timeout, naming the worker, when one dies or stalls: then
restart every worker with the same command and training resumes from the
last epoch backup. `StragglerMonitor` logs each worker's step time.

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
parser.add_argument(
    "--backup-dir",
    default=None,
    help="BackupAndRestore folder every worker reaches (default: a "
    "temporary folder, fine for the local cluster)",
)
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
    if args.backup_dir is None:
        # Chosen once, here: every local worker must see the same folder.
        sys.argv += ["--backup-dir", tempfile.mkdtemp(prefix="backup_")]
    sys.exit(launch_local_cluster())

# ----------------------------------------------------------------------
# Worker: TF_CONFIG is set. The strategy comes first, before any other
# TensorFlow call, so the collective runtime can start.
# ----------------------------------------------------------------------
import warnings  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

strategy = tf.distribute.MultiWorkerMirroredStrategy()

import keras_mgpu  # noqa: E402
from keras_mgpu import callbacks  # noqa: E402
from keras_mgpu.distribute import worker_info  # noqa: E402

keras_mgpu.distribute.enable_multi_worker_fit()  # keras-team/keras#20585
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
# Whole batches only: a partial last batch is weighted per replica by Keras.
x, y = (
    x[: len(x) // micro_batch * micro_batch],
    y[: len(y) // micro_batch * micro_batch],
)

with strategy.scope():
    keras.utils.set_random_seed(0)  # the same initial weights everywhere
    inputs = keras.Input((32,))
    hidden = keras.layers.Dense(256, activation="relu")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(10)(hidden))
    model.compile(
        optimizer=keras_mgpu.GradientAccumulationOptimizer(
            keras.optimizers.Adam(BASE_LEARNING_RATE), ACCUMULATION_STEPS
        ),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )

global_batch = keras_mgpu.global_batch_size(
    PER_REPLICA_BATCH, strategy, model.optimizer
)
print(
    f"task {info['task_id']} of {info['num_workers']} workers"
    f"{' (chief)' if info['is_chief'] else ''}: {replicas} replicas, "
    f"global batch {global_batch} = {PER_REPLICA_BATCH} x {replicas} x "
    f"{ACCUMULATION_STEPS} accumulation",
    flush=True,
)
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # the monitors' "no GPU here" notes
    history = model.fit(
        x,
        y,
        batch_size=micro_batch,  # global, as always under a strategy
        epochs=EPOCHS,
        validation_data=(x_val, y_val),
        verbose=2 if info["is_chief"] else 0,
        callbacks=[
            callbacks.LearningRateScaler(
                base_batch_size=BASE_BATCH_SIZE,
                per_replica_batch_size=PER_REPLICA_BATCH,
            ),
            callbacks.LearningRateWarmup(warmup_epochs=1),
            callbacks.MemoryMonitor(gather_workers=True),
            callbacks.StragglerMonitor(),
            callbacks.WorkerWatchdog(timeout=120),
            callbacks.BackupAndRestore(args.backup_dir),
        ],
    )

logs = history.history
accuracy = float(logs["val_accuracy"][-1])
print(
    f"updates: {int(model.optimizer.iterations.numpy())}, final validation "
    f"accuracy: {accuracy:.4f}, slowest/fastest worker: "
    f"{logs['workers/step_time_ratio'][-1]:.2f}, weights checksum: "
    f"{sum(float(np.sum(w)) for w in model.get_weights()):.6f}",
    flush=True,
)

"""A preempted job resumes where it stopped, and ends as if never stopped.

Preemptible (spot) machines and cluster schedulers kill jobs without
warning, then start them again with the same command. With
`keras_mgpu.callbacks.BackupAndRestore` in `fit`'s callbacks, the restarted
job restores the last backup (weights, optimizer state, the gradient
accumulators of `GradientAccumulationOptimizer`, the epoch counter) and
goes on from there.

Here the script plays the scheduler: it starts the training job as a child
process, which SIGKILLs itself in the middle of epoch 2 (half-way through
an accumulation window), starts the same command again, and the job
resumes at epoch 2 from the backup written at the end of epoch 1. Then it
trains the same model uninterrupted and prints the largest difference
between the two runs' final weights.

Resuming is exact when an epoch's data do not depend on how many epochs
ran before in the process: `shuffle=False` (as here), or a `tf.data`
pipeline shuffled with a seed per epoch. Backups are committed atomically:
a job killed while writing one keeps the previous one.

Run:
    python examples/preemption_resume.py             # all GPUs (or 2 CPUs)
    python examples/preemption_resume.py --quick     # seconds, on CPU
In your own job, only the `train` function below matters: put
`BackupAndRestore(backup_dir)` in the callbacks and restart the same
command after a failure (`backup_dir` on storage that survives the machine).
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--quick", action="store_true", help="tiny run")
parser.add_argument("--cpu-devices", type=int, default=2)
parser.add_argument("--output", default="preemption_resume_run")
# Set by the script for its child processes.
parser.add_argument("--role", choices=["job", "reference"], default=None)
parser.add_argument("--kill-in-epoch", type=int, default=None)
args = parser.parse_args()

EPOCHS = 3 if args.quick else 10
KILL_IN_EPOCH = 2 if args.quick else 6  # 1-based, as Keras prints epochs
SAMPLES = 1024 if args.quick else 65536
WIDTH = 64 if args.quick else 1024
PER_REPLICA_BATCH = 32
ACCUMULATION_STEPS = 2


def train(backup_dir, weights_path, kill_in_epoch=None):
    """The training job: what you would run, plus a simulated preemption."""
    import numpy as np
    import tensorflow as tf

    # Devices first: logical CPU devices can only be set before TensorFlow
    # starts its runtime.
    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        for gpu in gpus:
            tf.config.experimental.set_memory_growth(gpu, True)
    else:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * args.cpu_devices,
        )
    import keras

    import keras_mgpu
    from keras_mgpu.callbacks import BackupAndRestore, LearningRateWarmup

    # Seeded data and initial weights: every start builds the same model,
    # which the backup then overwrites.
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 32)).astype("float32")
    w = np.random.default_rng(1).normal(size=(32, 10)).astype("float32")
    y = np.argmax(x @ w, axis=1).astype("int32")

    devices = [d.name for d in tf.config.list_logical_devices("GPU")] or [
        d.name for d in tf.config.list_logical_devices("CPU")
    ]
    strategy = tf.distribute.MirroredStrategy(devices)
    with strategy.scope():
        model = keras.Sequential(
            [
                keras.Input((32,)),
                keras.layers.Dense(WIDTH, activation="relu"),
                keras.layers.Dense(WIDTH, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras_mgpu.GradientAccumulationOptimizer(
                keras.optimizers.Adam(1e-3), ACCUMULATION_STEPS
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )

    class Preemption(keras.callbacks.Callback):
        """Reports where this process started; SIGKILLs it mid-epoch."""

        def __init__(self):
            super().__init__()
            self.epoch = None

        def on_epoch_begin(self, epoch, logs=None):
            if self.epoch is None:
                print(f"[{args.role}] first epoch run: {epoch + 1}", flush=True)
            self.epoch = epoch

        def on_train_batch_end(self, batch, logs=None):
            steps = self.params["steps"]
            # An odd step: the kill lands inside an accumulation window.
            if self.epoch + 1 == kill_in_epoch and batch == steps // 2 + 1:
                print(
                    f"[{args.role}] SIGKILL in epoch {self.epoch + 1}, "
                    f"step {batch + 1}/{steps}",
                    flush=True,
                )
                os.kill(os.getpid(), signal.SIGKILL)

    model.fit(
        x,
        y,
        batch_size=PER_REPLICA_BATCH * strategy.num_replicas_in_sync,
        epochs=EPOCHS,
        shuffle=False,
        verbose=0,
        callbacks=[
            # First, so that a restored run's epoch counter is in place
            # before the other callbacks start.
            BackupAndRestore(backup_dir),
            LearningRateWarmup(warmup_epochs=1),
            Preemption(),
        ],
    )
    updates = int(model.optimizer.iterations.numpy())
    print(f"[{args.role}] finished, updates: {updates}", flush=True)
    np.savez(weights_path, *[np.asarray(v) for v in model.get_weights()])


def start_child(role, *extra):
    """One start of the job, as a scheduler would run it."""
    command = [sys.executable, os.path.abspath(__file__), "--role", role]
    command += ["--output", args.output, "--cpu-devices", str(args.cpu_devices)]
    command += ["--quick"] * args.quick + list(extra)
    return subprocess.Popen(command)


if args.role is not None:  # a child: one start of a training job
    name = "job" if args.role == "job" else "reference"
    train(
        os.path.join(args.output, f"{name}_backup"),
        os.path.join(args.output, f"{name}_weights.npz"),
        args.kill_in_epoch,
    )
    sys.exit(0)

# The scheduler. A fresh start: no backups left from an earlier run.
for name in ("job_backup", "reference_backup"):
    shutil.rmtree(os.path.join(args.output, name), ignore_errors=True)
os.makedirs(args.output, exist_ok=True)
# The uninterrupted run, for comparison, alongside (its own backup_dir).
reference = start_child("reference")
try:
    print(f"start 1 of the job (killed in epoch {KILL_IN_EPOCH})", flush=True)
    code = start_child("job", "--kill-in-epoch", str(KILL_IN_EPOCH)).wait()
    print(f"start 1 exited with {code} (-9 is SIGKILL)", flush=True)
    if code != -signal.SIGKILL:
        sys.exit(f"expected the job to die of SIGKILL, it exited with {code}")
    print("start 2 of the job: the same command", flush=True)
    if start_child("job").wait() != 0:
        sys.exit("the restarted job failed")
    if reference.wait() != 0:
        sys.exit("the uninterrupted run failed")
finally:
    if reference.poll() is None:  # never leave it running
        reference.kill()
        reference.wait()

import numpy as np  # noqa: E402

resumed = np.load(os.path.join(args.output, "job_weights.npz"))
reference = np.load(os.path.join(args.output, "reference_weights.npz"))
difference = max(
    float(np.max(np.abs(resumed[key] - reference[key]))) for key in reference
)
print(f"max abs weight difference, resumed vs uninterrupted: {difference:.3g}")

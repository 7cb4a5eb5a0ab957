"""Ray Train: Keras 3 `model.fit` with keras_mgpu on a `TensorflowTrainer`.

Ray Train starts the workers, sets `TF_CONFIG` on each and runs
`train_loop_per_worker` there under MultiWorkerMirroredStrategy. It also
sets `TF_USE_LEGACY_KERAS=1` on every worker (its workaround for Keras 3's
multi-worker `fit`, keras-team/keras#20585); the code below is ordinary
Keras 3 (`import keras`) all the same: keras_mgpu's components follow the
Keras 3 objects they are given, and `enable_multi_worker_fit()` makes
Keras 3's `fit` work there.

Run (needs `pip install "keras-mgpu[ray]"`):
    python examples/ray_train.py            # 2 CPU workers on this machine
    python examples/ray_train.py --quick    # seconds
Point `ray.init` at your cluster (`RAY_ADDRESS`) to run on real hosts, and
`--backup-dir` at storage every worker reaches.
"""

import argparse
import json
import os
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
if "RAY_ADDRESS" not in os.environ:
    # A Ray of this machine only: Ray then addresses its nodes, and Ray
    # Train its workers' TF_CONFIG, on 127.0.0.1 instead of the machine's
    # network address. Set before Ray is imported; its processes inherit it.
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--quick", action="store_true", help="tiny run")
parser.add_argument("--workers", type=int, default=2)
parser.add_argument("--backup-dir", default=None)
args = parser.parse_args()


def train_loop_per_worker(config: dict) -> None:
    """Runs on every Ray worker: plain Keras 3 plus keras_mgpu."""
    import warnings

    import keras
    import numpy as np
    import ray.train
    import tensorflow as tf

    import keras_mgpu
    from keras_mgpu import callbacks

    keras_mgpu.distribute.enable_multi_worker_fit()  # keras-team/keras#20585
    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(config["samples"], 32)).astype("float32")
    rule = np.random.default_rng(1).normal(size=(32, 10)).astype("float32")
    y = np.argmax(x @ rule, axis=1).astype("int32")
    per_replica = 32
    micro_batch = per_replica * strategy.num_replicas_in_sync

    with strategy.scope():
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((32,)),
                keras.layers.Dense(128, activation="relu"),
                keras.layers.Dense(10),
            ]
        )
        model.compile(
            optimizer=keras_mgpu.GradientAccumulationOptimizer(
                keras.optimizers.Adam(1e-3), accumulation_steps=2
            ),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the monitors' "no GPU here" notes
        history = model.fit(
            x,
            y,
            batch_size=micro_batch,
            epochs=config["epochs"],
            verbose=0,
            callbacks=[
                callbacks.LearningRateScaler(
                    base_batch_size=32, per_replica_batch_size=per_replica
                ),
                callbacks.LearningRateWarmup(warmup_epochs=1),
                callbacks.MemoryMonitor(gather_workers=True),
                callbacks.StragglerMonitor(),
                callbacks.WorkerWatchdog(timeout=120),
                callbacks.BackupAndRestore(config["backup_dir"]),
            ],
        )
    weights = model.get_weights()
    figures = {
        "rank": ray.train.get_context().get_world_rank(),
        "accuracy": float(history.history["accuracy"][-1]),
        "updates": int(model.optimizer.iterations.numpy()),
        "checksum": float(sum(float(np.sum(w)) for w in weights)),
        "optimizer": type(model.optimizer).__module__,
        "TF_USE_LEGACY_KERAS": os.environ.get("TF_USE_LEGACY_KERAS"),
        "TF_CONFIG": os.environ.get("TF_CONFIG"),
    }
    # Every worker's figures, for the driver to compare.
    with open(
        os.path.join(config["out_dir"], f"{figures['rank']}.json"), "w"
    ) as f:
        json.dump(figures, f)
    ray.train.report({k: figures[k] for k in ("accuracy", "updates")})


def main() -> None:
    try:
        import ray
        from ray.train import RunConfig, ScalingConfig
        from ray.train.tensorflow import TensorflowTrainer
    except ImportError as exc:
        raise SystemExit(
            'This example needs Ray Train: pip install "keras-mgpu[ray]"'
        ) from exc

    storage = tempfile.mkdtemp(prefix="ray_train_")
    out_dir = os.path.join(storage, "workers")
    os.makedirs(out_dir)
    config = {
        "out_dir": out_dir,
        "samples": 1024 if args.quick else 8192,
        "epochs": 2 if args.quick else 6,
        "backup_dir": args.backup_dir or os.path.join(storage, "backup"),
    }
    if "RAY_ADDRESS" not in os.environ:
        # A local Ray on this machine only; logical CPUs: one per worker
        # plus Ray Train's own controller.
        ray.init(num_cpus=args.workers + 2, include_dashboard=False)
    trainer = TensorflowTrainer(
        train_loop_per_worker,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
        run_config=RunConfig(name="keras_mgpu", storage_path=storage),
    )
    trainer.fit()
    ray.shutdown()
    for name in sorted(os.listdir(out_dir)):
        with open(os.path.join(out_dir, name)) as f:
            w = json.load(f)
        print(
            f"worker {w['rank']}: updates {w['updates']}, accuracy "
            f"{w['accuracy']:.4f}, weights checksum {w['checksum']:.6f}, "
            f"optimizer {w['optimizer']}, TF_USE_LEGACY_KERAS="
            f"{w['TF_USE_LEGACY_KERAS']}, TF_CONFIG={w['TF_CONFIG']}",
            flush=True,
        )


if __name__ == "__main__":
    main()

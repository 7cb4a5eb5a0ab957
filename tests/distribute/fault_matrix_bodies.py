"""Process bodies for tests/distribute/test_fault_matrix.py: one small
training run with keras_mgpu's BackupAndRestore, killed (SIGKILL) at a
chosen point, then restarted. TensorFlow: `train` (one process, or a
MultiWorkerMirroredStrategy cluster). JAX: `train_jax` (a 2-process x
2-CPU-device cluster under `keras.distribution.DataParallel`, each process
feeding its slice of every global batch) and `restart_jax` (the whole job
restarted from each case's backup in turn, one cluster for every case).

Kill points inside the callback's commit protocol come from its test-only
seam, the environment variable KERAS_MGPU_TEST_KILL_AT (`point:role[:n]`,
see `BackupAndRestore._test_kill`); kills at a training step or during
validation come from the `_Killer` callback here.
"""

from __future__ import annotations

import os
import signal
import warnings

from distribute._tiny_regression import compiled_model, data

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

SAMPLES = 48
GLOBAL_BATCH = 8  # 6 steps an epoch
EPOCHS = 3
ACCUMULATION = 4  # windows straddle the epochs
WARMUP_UPDATES = 4  # of 4 updates in all: every backup is mid-warmup


def _data():
    return data(SAMPLES, 1)


def _compiled_model():
    from keras_mgpu import GradientAccumulationOptimizer

    return compiled_model(
        3,
        lambda keras: GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1, momentum=0.5), ACCUMULATION
        ),
    )


def _killer(stop: list, is_chief: bool):
    """SIGKILL this process at a training step (`["step", epoch, batch,
    role]`) or a validation step (`["validation", epoch, role]`)."""
    from keras_mgpu._flavour import keras

    kind, *where, role = stop
    if (role == "chief" and not is_chief) or (role == "worker" and is_chief):
        return keras.callbacks.Callback()

    class Killer(keras.callbacks.Callback):
        epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            if kind == "step" and [self.epoch, batch] == where:
                os.kill(os.getpid(), signal.SIGKILL)

        def on_test_batch_begin(self, batch, logs=None):
            if kind == "validation" and [self.epoch, batch] == [where[0], 1]:
                os.kill(os.getpid(), signal.SIGKILL)

    return Killer()


def train(
    position: int,
    backup_dir: str,
    save_freq,
    double_checkpoint: bool,
    stop: list | None = None,
    multi_worker: bool = True,
) -> dict:
    """The run under test; killed where `stop` or the seam says."""
    import tensorflow as tf

    import keras_mgpu
    from keras_mgpu.distribute.strategy import worker_info

    if multi_worker:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        keras_mgpu.distribute.enable_multi_worker_fit()
        info = worker_info(strategy)
    else:
        strategy = tf.distribute.get_strategy()
        info = {"rank": 0, "is_chief": True, "task_name": "local"}
    with strategy.scope():
        model = _compiled_model()
    x, y = _data()
    error, epochs_run = fit_with_backup(
        model,
        (backup_dir, save_freq, double_checkpoint, stop),
        bool(info["is_chief"]),
        dict(x=x, y=y, batch_size=GLOBAL_BATCH, shuffle=False),
        (x[:16], y[:16]),
    )
    return {
        "error": error,
        "epochs_run": epochs_run,
        "rank": info["rank"],
        "task_name": info["task_name"],
        "weights": [w.tolist() for w in model.get_weights()],
        "updates": updates(model),
    }


def updates(model) -> int:
    """The optimizer's update count, on any backend."""
    import numpy as np

    return int(np.asarray(model.optimizer.iterations))


def fit_with_backup(
    model, case: tuple, is_chief: bool, inputs: dict, validation_data
) -> tuple:
    """`model.fit(**inputs)` for `EPOCHS` with BackupAndRestore
    (`case`: backup_dir, save_freq, double_checkpoint, stop),
    LearningRateWarmup and the killer `stop` asks for; returns the error
    (None) and the epochs run. Shared by the TensorFlow and JAX matrices."""
    from keras_mgpu.callbacks import BackupAndRestore, LearningRateWarmup

    backup_dir, save_freq, double_checkpoint, stop = case
    callbacks = [
        BackupAndRestore(
            backup_dir,
            save_freq=save_freq,
            double_checkpoint=double_checkpoint,
        ),
        LearningRateWarmup(warmup_steps=WARMUP_UPDATES),
    ]
    if stop:
        callbacks.append(_killer(stop, is_chief))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            history = model.fit(
                **inputs,
                epochs=EPOCHS,
                validation_data=validation_data,
                verbose=0,
                callbacks=callbacks,
            )
    except Exception as exc:  # reported, not raised: the test asserts on it
        return f"{type(exc).__name__}: {exc}"[-3000:], None
    return None, history.epoch


def reference() -> dict:
    """The uninterrupted run: one process, no strategy, no backup."""
    from keras_mgpu.callbacks import LearningRateWarmup

    model = _compiled_model()
    x, y = _data()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.fit(
            x,
            y,
            batch_size=GLOBAL_BATCH,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[LearningRateWarmup(warmup_steps=WARMUP_UPDATES)],
        )
    return {
        "weights": [w.tolist() for w in model.get_weights()],
        "updates": updates(model),
    }


# ----------------------------------------------------------------------
# JAX: a jax.distributed cluster under DataParallel
# ----------------------------------------------------------------------
def _fit_jax(case: tuple) -> dict:
    import sys

    import jax
    import keras

    from keras_mgpu.distribute import shard_across_processes, worker_info

    info = worker_info()
    distribution = keras.distribution.DataParallel(
        devices=jax.devices(), auto_shard_dataset=False
    )
    x, y = _data()
    with distribution.scope():
        model = _compiled_model()
        error, epochs_run = fit_with_backup(
            model,
            case,
            bool(info["is_chief"]),
            dict(
                x=shard_across_processes(
                    x, y, batch_size=GLOBAL_BATCH, shuffle=False
                )
            ),
            shard_across_processes(
                x[:16], y[:16], batch_size=GLOBAL_BATCH, shuffle=False
            ),
        )
    return {
        "error": error,
        "epochs_run": epochs_run,
        "rank": info["rank"],
        "weights": [w.tolist() for w in model.get_weights()],
        "updates": updates(model),
        "tensorflow_imported": "tensorflow" in sys.modules,
    }


def train_jax(
    backup_dir: str, save_freq, double_checkpoint: bool, stop
) -> dict:
    """One job; SIGKILLed where `stop` (a step or a validation step) or
    the callback's seam (KERAS_MGPU_TEST_KILL_AT) says."""
    return _fit_jax((backup_dir, save_freq, double_checkpoint, stop))


def restart_jax(cases: list, unshared: list) -> dict:
    """Restart the job of each `(backup_dir, save_freq, double_checkpoint)`
    from its backup, one after another in this cluster; then the refusals:
    `unshared[rank]` as each process's own backup_dir (a folder that is not
    shared), and a model whose kernel is split across the processes."""
    from keras_mgpu.distribute import worker_info

    rank = worker_info()["rank"]
    return {
        "cases": [_fit_jax((*case, None)) for case in cases],
        "unshared": _fit_jax((unshared[rank], 2, False, None))["error"],
        **_split_state(unshared[0] + "-split"),
    }


def _split_state(backup_dir: str) -> dict:
    """`ModelParallel` over a 2 x 2 mesh that shards a kernel along the
    "model" axis, across the processes (each holds half of it) or within
    each process: BackupAndRestore refuses both at `on_train_begin`, on
    every process. (Keras's own `save_weights` on the first raises
    "Fetching value for `jax.Array` that spans non-addressable devices"
    and leaves the processes' collectives out of step: measured, not run
    here.)"""
    import jax
    import keras
    import numpy as np

    from keras_mgpu.callbacks import BackupAndRestore
    from keras_mgpu.distribute import shard_across_processes

    devices = np.array(jax.devices()).reshape(2, 2)  # a row per process
    x, y = _data()
    out = {}
    for name, mesh_devices in (("local", devices), ("split", devices.T)):
        mesh = keras.distribution.DeviceMesh(
            (2, 2), ["batch", "model"], mesh_devices
        )
        layout_map = keras.distribution.LayoutMap(mesh)
        layout_map[".*wide/kernel"] = (None, "model")
        distribution = keras.distribution.ModelParallel(
            layout_map=layout_map,
            batch_dim_name="batch",
            auto_shard_dataset=False,
        )
        with distribution.scope():
            model = keras.Sequential(
                [
                    keras.Input((5,)),
                    keras.layers.Dense(8, name="wide"),
                    keras.layers.Dense(1, name="out"),
                ]
            )
            model.compile(optimizer="sgd", loss="mse")
            out[f"{name}_error"] = _error(
                model.fit,
                shard_across_processes(x, y, batch_size=8, shuffle=False),
                epochs=1,
                verbose=0,
                callbacks=[BackupAndRestore(f"{backup_dir}-{name}")],
            )
    return out


def _error(call, *args, **kwargs) -> str | None:
    try:
        call(*args, **kwargs)
    except Exception as exc:  # reported, not raised
        return f"{type(exc).__name__}: {exc}"
    return None

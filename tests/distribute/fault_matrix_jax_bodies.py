"""Process bodies for tests/distribute/test_fault_matrix_jax.py: the run of
tests/distribute/fault_matrix_bodies.py (same model, data, accumulation
windows straddling epochs, warmup, kill points) on a 2-process x 2-CPU-device
JAX cluster, under a `keras.distribution.DataParallel` over every process's
devices, each process feeding its slice of every global batch.

`train` is one job, killed where its case says; `restart` restarts the
whole job from each case's backup in turn (one cluster for every case).
"""

from __future__ import annotations

from distribute import fault_matrix_bodies as shared


def _fit(case: tuple) -> dict:
    import sys

    import jax
    import keras

    from keras_mgpu.distribute import shard_across_processes, worker_info

    info = worker_info()
    distribution = keras.distribution.DataParallel(
        devices=jax.devices(), auto_shard_dataset=False
    )
    x, y = shared._data()
    with distribution.scope():
        model = shared._compiled_model()
        error, epochs_run = shared.fit_with_backup(
            model,
            case,
            bool(info["is_chief"]),
            dict(
                x=shard_across_processes(
                    x, y, batch_size=shared.GLOBAL_BATCH, shuffle=False
                )
            ),
            shard_across_processes(
                x[:16], y[:16], batch_size=shared.GLOBAL_BATCH, shuffle=False
            ),
        )
    return {
        "error": error,
        "epochs_run": epochs_run,
        "rank": info["rank"],
        "weights": [w.tolist() for w in model.get_weights()],
        "updates": shared.updates(model),
        "tensorflow_imported": "tensorflow" in sys.modules,
    }


def train(backup_dir: str, save_freq, double_checkpoint: bool, stop) -> dict:
    """One job; SIGKILLed where `stop` (a step or a validation step) or
    the callback's seam (KERAS_MGPU_TEST_KILL_AT) says."""
    return _fit((backup_dir, save_freq, double_checkpoint, stop))


def restart(cases: list, unshared: list) -> dict:
    """Restart the job of each `(backup_dir, save_freq, double_checkpoint)`
    from its backup, one after another in this cluster; then the refusals:
    `unshared[rank]` as each process's own backup_dir (a folder that is not
    shared), and a model whose kernel is split across the processes."""
    from keras_mgpu.distribute import worker_info

    rank = worker_info()["rank"]
    return {
        "cases": [_fit((*case, None)) for case in cases],
        "unshared": _fit((unshared[rank], 2, False, None))["error"],
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
    x, y = shared._data()
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

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


def restart(cases: list) -> list:
    """Restart the job of each `(backup_dir, save_freq, double_checkpoint)`
    from its backup, one after another in this cluster."""
    return [_fit((*case, None)) for case in cases]

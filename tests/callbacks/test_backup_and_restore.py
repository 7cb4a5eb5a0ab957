"""keras_mgpu.callbacks.BackupAndRestore on one process: Keras's behaviour
(exact resume mid-window, epoch granularity) plus the atomic commit, the
double checkpoint and the workers' agreement check. The multi-worker kill /
restart runs are in tests/distribute/test_worker_failures.py."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
from _training import mlp, regression_data
from conftest import make_strategy

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras
from keras_mgpu.callbacks import BackupAndRestore, LearningRateWarmup


class _Interrupt(keras.callbacks.Callback):
    def __init__(self, epoch: int, batch: int) -> None:
        super().__init__()
        self.at = (epoch, batch)
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        if (self.epoch, batch) == self.at:
            raise RuntimeError("interrupted")


def _run(strategy, backup, callbacks=(), epochs=4):
    x, y = regression_data(40)
    with strategy.scope():
        model = mlp()
        model.compile(
            optimizer=GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.1, momentum=0.5), 3
            ),
            loss="mse",
        )
    history = model.fit(
        x,
        y,
        batch_size=8,  # 5 steps an epoch: windows of 3 straddle epochs
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[
            *([BackupAndRestore(backup)] if backup else []),
            LearningRateWarmup(warmup_steps=5),
            *callbacks,
        ],
    )
    return model, history


@pytest.mark.parametrize("name", ["default", "mirrored_2"])
def test_interrupted_run_resumes_to_the_uninterrupted_weights(name, tmp_path):
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _run(make_strategy(name), backup, [_Interrupt(2, 3)])
    with open(os.path.join(backup, "training_metadata.json")) as f:
        assert json.load(f)["epoch"] == 2
    model, history = _run(make_strategy(name), backup)
    assert history.epoch == [2, 3]
    reference, _ = _run(make_strategy("default"), None)
    for a, b in zip(model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == int(
        reference.optimizer.iterations.numpy()
    )
    assert not os.path.exists(backup)  # deleted at the end, as Keras's


def test_a_kill_during_a_save_leaves_the_previous_backup(tmp_path, monkeypatch):
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _run(make_strategy("default"), backup, [_Interrupt(2, 0)])
    before = sorted(os.listdir(backup))

    def half_written(self, filepath, overwrite=True, **kwargs):
        with open(filepath, "wb") as f:
            f.write(b"\x89HDF partial")
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(keras.Model, "save_weights", half_written)
    with pytest.raises(KeyboardInterrupt):
        _run(make_strategy("default"), backup)
    monkeypatch.undo()
    with open(os.path.join(backup, "training_metadata.json")) as f:
        metadata = json.load(f)
    assert metadata["epoch"] == 2 and metadata["weights"] in before
    model, history = _run(make_strategy("default"), backup)
    assert history.epoch == [2, 3]


def test_double_checkpoint_falls_back_to_the_previous_backup(tmp_path):
    backup = str(tmp_path / "backup")
    callback = BackupAndRestore(backup, double_checkpoint=True)
    x, y = regression_data(16)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(RuntimeError):
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=4,
            verbose=0,
            callbacks=[callback, _Interrupt(3, 0)],
        )
    with open(os.path.join(backup, "training_metadata.json")) as f:
        metadata = json.load(f)
    assert metadata["previous"]["epoch"] == 2
    with open(os.path.join(backup, metadata["weights"]), "wb") as f:
        f.write(b"corrupt")
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=4,
        verbose=0,
        callbacks=[BackupAndRestore(backup, double_checkpoint=True)],
    )
    assert history.epoch == [2, 3]


def test_workers_that_see_different_backups_are_named(tmp_path, monkeypatch):
    from keras_mgpu.callbacks import backup_and_restore as module
    from keras_mgpu.distribute import collectives

    callback = BackupAndRestore(str(tmp_path))
    callback._num_workers, callback._task_id = 2, 0
    monkeypatch.setattr(
        collectives, "gather_rows", lambda strategy, row: np.array([[3], [-1]])
    )
    monkeypatch.setattr(callback, "_strategy", lambda: None)
    with pytest.raises(
        ValueError,
        match=r"worker 0: the backup of epoch 3, worker 1: no backup\). "
        r"Under multi-worker training, backup_dir must be storage every "
        "worker reaches",
    ):
        callback._check_workers_agree({"epoch": 3})
    del module


def test_reads_a_backup_written_by_keras(tmp_path):
    backup = str(tmp_path / "backup")
    x, y = regression_data(16)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.raises(RuntimeError):
        model.fit(
            x,
            y,
            batch_size=8,
            epochs=3,
            verbose=0,
            callbacks=[
                keras.callbacks.BackupAndRestore(backup),
                _Interrupt(2, 0),
            ],
        )
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=3,
        verbose=0,
        callbacks=[BackupAndRestore(backup)],
    )
    assert history.epoch == [2]


@pytest.mark.parametrize("save_freq", [0, -2, True, "often"])
def test_bad_save_freq(save_freq, tmp_path):
    with pytest.raises(ValueError, match="save_freq"):
        BackupAndRestore(str(tmp_path), save_freq=save_freq)

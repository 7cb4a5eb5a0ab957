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
    from keras_mgpu.distribute import collectives

    def two_workers(strategy, row):
        # Worker 1 sees no metadata (it cannot reach the chief's storage).
        return np.array([row, [1.0, 0.0, *[0.0] * (len(row) - 2)]])

    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _run(make_strategy("default"), backup, [_Interrupt(1, 0)])
    monkeypatch.setattr(collectives, "gather_rows", two_workers)
    with pytest.raises(
        ValueError,
        match=r"\(worker 0: a backup \([0-9a-f]{12}\), worker 1: no backup "
        r"\([0-9a-f]{12}\)\)\. Under multi-worker training, backup_dir must "
        "be storage every worker reaches",
    ):
        _run(make_strategy("default"), backup)


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


@pytest.mark.parametrize("save_freq", [-2, True, "often", 0.5])
def test_bad_save_freq(save_freq, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"`save_freq` must be 'epoch', an integer >= 1 or False \(0\)"
        rf"\. Received: save_freq={save_freq!r}",
    ):
        BackupAndRestore(str(tmp_path), save_freq=save_freq)


@pytest.mark.parametrize("save_freq", [0, False])
def test_save_freq_false_restores_but_saves_nothing(save_freq, tmp_path):
    """Keras documents `save_freq=False` (no periodic saves; Keras 3.15
    accepts 0 and False): it restores a backup and writes none."""
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _run(make_strategy("default"), backup, [_Interrupt(2, 0)])
    assert BackupAndRestore(backup, save_freq=save_freq).save_freq is False
    _, history = _run_int(make_strategy("default"), backup, save_freq=save_freq)
    assert history.epoch == [2, 3]
    assert not os.path.exists(backup)  # delete_checkpoint=True
    fresh = str(tmp_path / "fresh")
    x, y = regression_data(16)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        callbacks=[
            BackupAndRestore(
                fresh, save_freq=save_freq, delete_checkpoint=False
            )
        ],
    )
    assert not os.path.exists(fresh)  # nothing was ever saved


def _reference_weights():
    model, _ = _run(make_strategy("default"), None)
    return model.get_weights(), int(model.optimizer.iterations.numpy())


def _assert_like_reference(model, reference):
    weights, updates = reference
    for a, b in zip(model.get_weights(), weights):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(model.optimizer.iterations.numpy()) == updates


def _run_int(strategy, backup, callbacks=(), save_freq=2, per_execution=1):
    x, y = regression_data(40)
    with strategy.scope():
        model = mlp()
        model.compile(
            optimizer=GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.1, momentum=0.5), 3
            ),
            loss="mse",
            steps_per_execution=per_execution,
        )
    history = model.fit(
        x,
        y,
        batch_size=8,
        epochs=4,
        shuffle=False,
        verbose=0,
        callbacks=[
            BackupAndRestore(backup, save_freq=save_freq),
            LearningRateWarmup(warmup_steps=5),
            *callbacks,
        ],
    )
    return model, history


def _metadata(backup):
    with open(os.path.join(backup, "training_metadata.json")) as f:
        return json.load(f)


@pytest.mark.parametrize(
    "name, per_execution",
    # MirroredStrategy / MultiWorker iterators: tests/distribute/
    # test_fault_matrix.py (the 2-process int save_freq cases).
    [("default", 1), ("default", 2)],
)
def test_int_save_freq_resumes_mid_epoch_exactly_across_two_crashes(
    name, per_execution, tmp_path
):
    """save_freq=2 of 5 steps an epoch: the backups fall mid-epoch. A restart
    resumes after the saved batch (not at the epoch's start, as Keras), and
    its own saves record the epoch it is in, so a second crash resumes from
    there too, not from epoch 0 with trained weights."""
    backup = str(tmp_path / "backup")

    def run(*callbacks):
        return _run_int(
            make_strategy(name), backup, callbacks, per_execution=per_execution
        )

    with pytest.raises(RuntimeError, match="interrupted"):
        run(_Interrupt(1, 4))
    # Saves every 2 batches, counted across epochs (with 2 steps an
    # execution: at the ends of executions), the last at (1, 2) or (1, 3).
    assert _metadata(backup)["epoch"] == 1
    assert _metadata(backup)["batch"] == (2 if per_execution == 1 else 3)
    with pytest.raises(RuntimeError, match="interrupted"):
        run(_Interrupt(2, 4))
    assert _metadata(backup)["epoch"] == 2
    model, history = run()
    assert history.epoch == [2, 3]
    _assert_like_reference(model, _reference_weights())


def test_first_save_after_a_restart_never_overwrites_the_backup(
    tmp_path, monkeypatch
):
    """A restarted process numbers its files afresh: its first save must
    not write over the committed backup (a kill during that write used to
    leave the metadata naming a torn file: "file signature not found")."""
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _run_int(make_strategy("default"), backup, [_Interrupt(0, 3)])
    committed = _metadata(backup)["weights"]

    def killed_while_writing(self, filepath, overwrite=True, **kwargs):
        with open(filepath, "wb") as f:
            f.write(b"\x89HDF torn")
        raise KeyboardInterrupt("killed while saving")

    monkeypatch.setattr(keras.Model, "save_weights", killed_while_writing)
    with pytest.raises(KeyboardInterrupt):
        _run_int(make_strategy("default"), backup)
    monkeypatch.undo()
    assert _metadata(backup)["weights"] == committed
    model, history = _run_int(make_strategy("default"), backup)
    assert history.epoch == [0, 1, 2, 3]
    _assert_like_reference(model, _reference_weights())


def test_a_kill_while_deleting_the_backup_leaves_no_pointer_to_a_lost_file(
    tmp_path, monkeypatch
):
    """delete_checkpoint removes the metadata before the files it names: a
    process killed in the middle of a (non-atomic) recursive delete leaves
    either the whole backup or no pointer, and the restart succeeds."""
    import tensorflow as tf

    backup = str(tmp_path / "backup")
    real_rmtree = tf.io.gfile.rmtree

    def killed_after_one_file(path):
        # A recursive delete removes one file at a time (here in name
        # order: the weights file comes first), then the process dies.
        first = sorted(os.listdir(path))[0]
        os.remove(os.path.join(path, first))
        raise KeyboardInterrupt("killed while deleting")

    monkeypatch.setattr(tf.io.gfile, "rmtree", killed_after_one_file)
    with pytest.raises(KeyboardInterrupt):
        _run(make_strategy("default"), backup)
    monkeypatch.setattr(tf.io.gfile, "rmtree", real_rmtree)
    model, _ = _run(make_strategy("default"), backup)
    _assert_like_reference(model, _reference_weights())


def test_refuses_a_restart_on_another_cluster_shape(tmp_path):
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _run(make_strategy("mirrored_2"), backup, [_Interrupt(1, 0)])
    with pytest.raises(
        ValueError,
        match=r"written by a job of 1 worker\(s\) and 2 replica\(s\); this "
        r"job has 1 worker\(s\) and 1 replica\(s\)\. .* restart with 1 "
        r"worker\(s\) and 2 replica\(s\), or delete backup_dir",
    ):
        _run(make_strategy("default"), backup)


def test_no_loadable_backup_is_a_clear_error(tmp_path):
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _run(make_strategy("default"), backup, [_Interrupt(1, 0)])
    with open(os.path.join(backup, _metadata(backup)["weights"]), "r+b") as f:
        f.truncate(100)
    with pytest.raises(
        ValueError,
        match=r"No backup in backup_dir=.* can be read by every worker: "
        r"'backup-.*' \(epoch 1\): worker 0 cannot read it \(here: .*"
        r"SHA-256 does not match\)\)\. No worker starts training",
    ):
        _run(make_strategy("default"), backup)


# Keras's test module marks tests for its own runner.
_KERAS_TEST_MARKS = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnknownMarkWarning"
)


@_KERAS_TEST_MARKS
@pytest.mark.parametrize(
    "case",
    [
        "test_best_case_epoch",
        "test_model_deleted_case_epoch",
        "test_backup_dir_empty_error",
    ],
)
def test_keras_own_tests_pass_against_ours(case, monkeypatch):
    """Keras's BackupAndRestore tests, run on ours (those that do not read
    Keras's file names, or Keras's re-training of a resumed epoch)."""
    import unittest

    from keras.src.callbacks import backup_and_restore_test as oracle

    monkeypatch.setattr(oracle.callbacks, "BackupAndRestore", BackupAndRestore)
    result = unittest.TestResult()
    oracle.BackupAndRestoreCallbackTest(case).run(result)
    assert result.wasSuccessful(), result.errors + result.failures


@_KERAS_TEST_MARKS
def test_keras_step_case_resumes_without_training_batches_twice(tmp_path):
    """Keras's `test_best_case_step` on ours: a canary counts the batches
    trained. Keras trains the resumed epoch's first batches again (17);
    ours resumes after the saved batch, as an uninterrupted run (15)."""
    from keras.src.callbacks import backup_and_restore_test as oracle

    model = oracle.BackupAndRestoreCallbackTest().make_model()
    callback = BackupAndRestore(str(tmp_path / "backup"), save_freq=1)
    x = np.random.random((10, 3))
    y = np.random.random((10, 1))
    with pytest.raises(RuntimeError, match="StepsInterruption"):
        model.fit(
            x,
            y,
            batch_size=4,
            epochs=2,
            verbose=0,
            callbacks=[callback, oracle.InterruptingCallback(2, None)],
        )
    assert (callback._current_epoch, callback._last_batch_seen) == (0, 1)
    history = model.fit(
        x, y, batch_size=4, epochs=5, verbose=0, callbacks=[callback]
    )
    assert callback._current_epoch == 5 and history.epoch[-1] == 4
    assert int(model.layers[0].counter.value) == 5 * 3

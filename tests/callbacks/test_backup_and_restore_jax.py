"""keras_mgpu.callbacks.BackupAndRestore on one JAX process: a fit
interrupted by an exception, resumed in a fresh model, ends at the weights of
the uninterrupted run (Adam's moments included), mid-epoch and at epoch ends,
with and without a `keras.distribution.DataParallel` in force."""

from __future__ import annotations

import contextlib
import json
import os
import sys

import keras
import numpy as np
import pytest
from _training import mlp, regression_data

from keras_mgpu.callbacks import BackupAndRestore

STEPS = 5  # 40 samples, batch 8: 5 steps an epoch
EPOCHS = 4


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


def _distribution(name: str):
    if name == "default":
        return None
    devices = keras.distribution.list_devices("cpu")
    return keras.distribution.DataParallel(devices=devices)


def _optimizer(accumulation: int | None = None):
    return keras.optimizers.Adam(0.01, gradient_accumulation_steps=accumulation)


def _run(
    name="default",
    backup=None,
    callbacks=(),
    save_freq="epoch",
    optimizer=_optimizer,
    per_execution=1,
):
    """Build, compile and fit inside the distribution's scope (the layout
    of a variable is fixed when it is created)."""
    x, y = regression_data(STEPS * 8)
    distribution = _distribution(name)
    scope = distribution.scope() if distribution else contextlib.nullcontext()
    with scope:
        model = mlp()
        model.compile(
            optimizer=optimizer(),
            loss="mse",
            steps_per_execution=per_execution,
        )
        history = model.fit(
            x,
            y,
            batch_size=8,
            epochs=EPOCHS,
            shuffle=False,
            verbose=0,
            callbacks=[
                *([BackupAndRestore(backup, save_freq)] if backup else []),
                *callbacks,
            ],
        )
    return model, history


_REFERENCES: dict = {}


def _reference(optimizer=_optimizer, key="adam"):
    """The uninterrupted run on the default device (computed once)."""
    if key not in _REFERENCES:
        model, _ = _run(optimizer=optimizer)
        _REFERENCES[key] = (
            model.get_weights(),
            [np.asarray(v) for v in model.optimizer.variables],
        )
    return _REFERENCES[key]


def _assert_like_reference(model, reference):
    weights, optimizer_variables = reference
    for a, b in zip(model.get_weights(), weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # Adam's moments and the step counters too, not only the weights.
    for a, b in zip(
        model.optimizer.variables, optimizer_variables, strict=True
    ):
        np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-6)


def _metadata(backup):
    with open(os.path.join(backup, "training_metadata.json")) as f:
        return json.load(f)


@pytest.mark.parametrize(
    "name, save_freq, interrupt, saved",
    [
        # Epoch backups: resumes at the epoch after the last one ended.
        ("default", "epoch", (2, 3), (2, -1)),
        ("data_parallel", "epoch", (2, 3), (2, -1)),
        # Every 3 batches of 5, counted across epochs (after the 3rd, 6th,
        # 9th, 12th batch): the last save before (2, 4) is after batch 1
        # of epoch 2, mid-epoch.
        ("default", 3, (2, 4), (2, 1)),
        ("data_parallel", 3, (2, 4), (2, 1)),
    ],
)
def test_interrupted_run_resumes_to_the_uninterrupted_weights(
    name, save_freq, interrupt, saved, tmp_path, monkeypatch
):
    # Nothing on this path may import TensorFlow (an import now fails).
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _run(name, backup, [_Interrupt(*interrupt)], save_freq)
    metadata = _metadata(backup)
    assert (metadata["epoch"], metadata["batch"]) == saved
    assert metadata["num_replicas"] == (4 if name == "data_parallel" else 1)
    trained = []

    class Count(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            trained.append(bool(logs))  # a skipped batch logs nothing

    model, history = _run(name, backup, [Count()], save_freq)
    assert history.epoch == list(range(saved[0], EPOCHS))
    # The batches the backup holds are read and dropped, not trained.
    assert sum(trained) == (EPOCHS - saved[0]) * STEPS - (saved[1] + 1)
    _assert_like_reference(model, _reference())
    assert not os.path.exists(backup)  # delete_checkpoint=True


@pytest.mark.slow
def test_two_steps_per_execution_resume_mid_epoch(tmp_path):
    """With 2 steps an execution, saves (every 2 batches) fall at the ends
    of executions: the last before (1, 4) is after batch 3 of epoch 1."""
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _run("data_parallel", backup, [_Interrupt(1, 4)], 2, per_execution=2)
    assert (_metadata(backup)["epoch"], _metadata(backup)["batch"]) == (1, 3)
    model, history = _run("data_parallel", backup, (), 2, per_execution=2)
    assert history.epoch == [1, 2, 3]
    _assert_like_reference(model, _reference())


def test_a_data_parallel_backup_resumes_on_one_device(tmp_path):
    """On JAX the step is one global program (optimizer state is global,
    not per replica): another device count resumes exactly, so the shape
    check that TensorFlow needs is not made here."""
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _run("data_parallel", backup, [_Interrupt(1, 2)], 2)
    model, _ = _run("default", backup, (), 2)
    _assert_like_reference(model, _reference())


@pytest.mark.slow
def test_keras_gradient_accumulation_resumes_mid_window(tmp_path):
    """Keras's built-in `gradient_accumulation_steps=3` over 5 steps an
    epoch: windows straddle epochs, and the backups (every 2 batches) fall
    inside windows; the accumulators are optimizer variables, so the
    resume is exact."""
    backup = str(tmp_path / "backup")

    def accumulating():
        return _optimizer(accumulation=3)

    with pytest.raises(RuntimeError, match="interrupted"):
        _run("data_parallel", backup, [_Interrupt(2, 2)], 2, accumulating)
    assert (_metadata(backup)["epoch"], _metadata(backup)["batch"]) == (2, 1)
    model, _ = _run("data_parallel", backup, (), 2, accumulating)
    reference = _reference(accumulating, key="adam_accumulating")
    _assert_like_reference(model, reference)
    assert int(model.optimizer.iterations) == (EPOCHS * STEPS) // 3


@pytest.mark.parametrize("name", ["default", "data_parallel"])
def test_accumulation_wrapper_resumes_mid_window(name, tmp_path):
    from keras_mgpu import GradientAccumulationOptimizer

    def wrapped():
        return GradientAccumulationOptimizer(keras.optimizers.Adam(0.01), 3)

    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _run(name, backup, [_Interrupt(2, 2)], 2, wrapped)
    assert (_metadata(backup)["epoch"], _metadata(backup)["batch"]) == (2, 1)
    model, _ = _run(name, backup, (), 2, wrapped)
    _assert_like_reference(model, _reference(wrapped, key="wrapped"))
    assert int(model.optimizer.iterations) == (EPOCHS * STEPS) // 3


@pytest.mark.parametrize("save_freq", [-2, True, "often", 0.5])
def test_bad_save_freq(save_freq, tmp_path):
    with pytest.raises(
        ValueError,
        match=r"`save_freq` must be 'epoch', an integer >= 1 or False \(0\)"
        rf"\. Received: save_freq={save_freq!r}",
    ):
        BackupAndRestore(str(tmp_path), save_freq=save_freq)


def test_no_loadable_backup_is_a_clear_error(tmp_path):
    backup = str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        _run("default", backup, [_Interrupt(1, 0)])
    with open(os.path.join(backup, _metadata(backup)["weights"]), "r+b") as f:
        f.truncate(100)
    with pytest.raises(
        ValueError,
        match=r"No backup in backup_dir=.* can be read by every worker: "
        r"'backup-.*' \(epoch 1\): worker 0 cannot read it \(here: .*"
        r"SHA-256 does not match\)\)\. No worker starts training",
    ):
        _run("default", backup)


def test_process_rows_travel_exactly(monkeypatch):
    """The processes' agreement gathers float64 rows (SHA-256 words of 48
    bits among them) through JAX, which rounds float64 to float32 unless
    x64 is on: they travel as uint32 words and come back bit-exact."""
    from jax.experimental import multihost_utils

    from keras_mgpu.backend.jax import backup

    row = [1.0, float(2**48 - 1), 0.1, -3.5e300]
    assert backup.gather_rows(row).tolist() == [row]  # one process
    sent = []

    def two_processes(words):
        sent.append(np.asarray(words))
        # What JAX returns: every process's array stacked, in JAX's dtype.
        return keras.ops.convert_to_numpy(keras.ops.stack([words, words + 0]))

    monkeypatch.setattr(backup, "several_processes", lambda: True)
    monkeypatch.setattr(multihost_utils, "process_allgather", two_processes)
    gathered = backup.gather_rows(row)
    assert sent[0].dtype == np.uint32
    assert gathered.dtype == np.float64
    assert gathered.tolist() == [row, row]


class _FakeDevice:
    def __init__(self, process_index):
        self.process_index = process_index


class _FakeSharding:
    def __init__(self, indices):
        self.indices = indices

    def devices_indices_map(self, shape):
        return self.indices


class _FakeValue:
    shape = (4, 8)

    def __init__(self, indices):
        self.sharding = _FakeSharding(indices)


class _FakeVariable:
    def __init__(self, path, indices):
        self.path = path
        self.value = _FakeValue(indices)


def _fake(path, per_device):
    """A variable whose shards sit on devices (process, columns)."""
    return _FakeVariable(
        path,
        {
            _FakeDevice(process): (slice(None), slice(*columns))
            for process, columns in per_device
        },
    )


def test_state_some_process_cannot_read_whole_is_named():
    from keras_mgpu.backend.jax.backup import unreadable_variables

    whole = (None, None)
    halves = ((0, 4), (4, 8))
    variables = [
        # DataParallel: replicated on every device of both processes.
        _fake("replicated", [(0, whole), (0, whole), (1, whole)]),
        # Model axis within each process: both halves on each process.
        _fake(
            "local",
            [(0, halves[0]), (0, halves[1]), (1, halves[0]), (1, halves[1])],
        ),
        # Model axis across processes: each process holds one half.
        _fake("split", [(0, halves[0]), (1, halves[1])]),
    ]
    assert unreadable_variables(variables) == ["split"]
    # Real arrays on this process's 4 devices: all readable.
    devices = keras.distribution.list_devices("cpu")
    with keras.distribution.DataParallel(devices=devices).scope():
        model = mlp()
    assert unreadable_variables(model.variables) == []


def test_split_state_is_refused_before_any_collective(monkeypatch, tmp_path):
    from keras_mgpu.backend.jax import backup
    from keras_mgpu.distribute import strategy

    calls = []
    monkeypatch.setattr(strategy, "is_multi_worker", lambda s=None: True)
    monkeypatch.setattr(
        backup, "unreadable_variables", lambda v: ["dense/kernel"] * 4
    )
    monkeypatch.setattr(backup, "gather_rows", calls.append)
    with pytest.raises(
        ValueError,
        match=r"needs every variable readable whole in each process "
        r"\(process 0 writes the backup\); 4 variable\(s\) are sharded "
        r"over devices of several processes by the distribution's layout "
        r"\(dense/kernel, dense/kernel, dense/kernel \.\.\.\)",
    ):
        _run("default", str(tmp_path / "backup"))
    assert calls == []  # raised before the processes' first collective

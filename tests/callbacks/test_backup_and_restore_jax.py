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
    bits among them) through jax.distributed's key-value store: bit-exact,
    in process order, each exchange under keys of its own, every wait
    bounded."""
    import jax

    from keras_mgpu.backend.jax import kv_store, processes

    row = [1.0, float(2**48 - 1), 0.1, -3.5e300]
    assert processes.allgather_rows(row).tolist() == [row]  # one process

    class Store:  # jax.distributed's client, holding process 1's rows
        def __init__(self):
            self.values, self.waits, self.deleted = {}, [], []

        def key_value_set(self, key, value):
            assert key not in self.values  # never overwritten
            self.values[key] = value
            other = key[: key.rindex("/")] + "/1"
            self.values[other] = np.asarray(row[::-1]).tobytes().hex()

        def blocking_key_value_get(self, key, timeout_in_ms):
            self.waits.append(timeout_in_ms)
            return self.values[key]

        def key_value_delete(self, key):
            self.deleted.append(key)
            del self.values[key]  # KeyError: an exchange before this test

    store = Store()
    monkeypatch.setattr(processes, "several_processes", lambda: True)
    monkeypatch.setattr(kv_store, "client", lambda: store)
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    first = next(processes._CALLS) + 1  # other tests' exchanges went before
    for _ in range(3):
        gathered = processes.allgather_rows(row)
        assert gathered.dtype == np.float64
        assert gathered.tolist() == [row, row[::-1]]
    # 3 exchanges x 2 processes, less this process's key of the first
    # (deleted at the third, when every process has read it)
    assert len(store.values) == 5
    assert store.deleted[-1] == f"{processes._PREFIX}/{first}/0"
    assert store.waits and all(0 < w <= 600_000 for w in store.waits)


def test_sharded_state_is_named():
    from keras_mgpu.backend.jax.backup import sharded_variables

    devices = keras.distribution.list_devices("cpu")
    with keras.distribution.DataParallel(devices=devices).scope():
        replicated = mlp()
    assert sharded_variables(replicated.variables) == []
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*dense.*kernel"] = (None, "model")
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    with distribution.scope():
        sharded = keras.Sequential(
            [keras.Input((4,)), keras.layers.Dense(8, name="dense_wide")]
        )
    assert sharded_variables(sharded.variables) == [
        sharded.layers[0].kernel.path
    ]


def test_split_state_is_refused_before_any_collective(monkeypatch, tmp_path):
    from keras_mgpu.backend.jax import backup, processes
    from keras_mgpu.distribute import strategy

    calls = []
    monkeypatch.setattr(strategy, "is_multi_worker", lambda s=None: True)
    monkeypatch.setattr(
        backup, "sharded_variables", lambda v: ["dense/kernel"] * 4
    )
    monkeypatch.setattr(processes, "allgather_rows", calls.append)
    with pytest.raises(
        ValueError,
        match=r"needs every variable replicated on every device \(a "
        r"keras.distribution.DataParallel\): .* 4 variable\(s\) are "
        r"sharded by the distribution's layout "
        r"\(dense/kernel, dense/kernel, dense/kernel \.\.\.\)",
    ):
        _run("default", str(tmp_path / "backup"))
    assert calls == []  # raised before the processes' first collective

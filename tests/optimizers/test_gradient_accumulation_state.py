"""Nothing is lost: resuming in the middle of an accumulation window.

Each test trains 2 epochs of 10 micro-batches with accumulation_steps=4, so
epoch 1 ends with 2 micro-batches pending, and compares the interrupted and
resumed run with the uninterrupted one.
"""

from __future__ import annotations

import numpy as np
import pytest
from _training import assert_weights_close, mlp, regression_data

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras, tf

ACCUMULATION = 4
BATCH = 4
SAMPLES = 40  # 10 micro-batches per epoch: epoch ends 2 into a window


def _compiled_model():
    model = mlp()
    inner = keras.optimizers.AdamW(0.01, weight_decay=0.1)
    model.compile(
        optimizer=GradientAccumulationOptimizer(inner, ACCUMULATION),
        loss="mse",
    )
    return model


def _fit(model, epochs, **kw):
    x, y = regression_data(SAMPLES)
    model.fit(
        x, y, batch_size=BATCH, epochs=epochs, shuffle=False, verbose=0, **kw
    )


_expected: list = []


def _uninterrupted(strategy=None):
    """The uninterrupted run on one device (computed once per module).

    Every strategy is compared with the one-device result.
    """
    if not _expected:
        model = _compiled_model()
        _fit(model, epochs=2)
        _expected.append(model.get_weights())
        keras.backend.clear_session()
    return _expected[0]


def _assert_mid_window(model):
    optimizer = model.optimizer
    assert int(optimizer.pending_steps.numpy()) == 2
    assert int(optimizer.iterations.numpy()) == 2
    total = sum(float(np.abs(a.numpy()).sum()) for a in optimizer.accumulators)
    assert total > 0


def test_keras_file_round_trip_resumes_mid_window(strategy, tmp_path):
    expected = _uninterrupted(strategy)
    keras.backend.clear_session()
    with strategy.scope():
        model = _compiled_model()
    _fit(model, epochs=1)
    _assert_mid_window(model)
    path = str(tmp_path / "model.keras")
    model.save(path)
    with strategy.scope():
        restored = keras.saving.load_model(path)
    assert isinstance(restored.optimizer, GradientAccumulationOptimizer)
    assert restored.optimizer.accumulation_steps == ACCUMULATION
    _assert_mid_window(restored)
    _fit(restored, epochs=1)
    assert_weights_close(restored.get_weights(), expected)
    assert int(restored.optimizer.iterations.numpy()) == 5


@pytest.mark.parametrize("strategy_name", ["one_device", "mirrored_2"])
def test_tf_checkpoint_resumes_mid_window(strategy_name, tmp_path):
    from conftest import make_strategy

    strategy = make_strategy(strategy_name)
    expected = _uninterrupted(strategy)
    keras.backend.clear_session()
    with strategy.scope():
        model = _compiled_model()
    _fit(model, epochs=1)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=model.optimizer)
    path = checkpoint.save(str(tmp_path / "ckpt"))

    keras.backend.clear_session()
    with strategy.scope():
        fresh = _compiled_model()
        fresh.optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(
        path
    ).assert_consumed()
    _assert_mid_window(fresh)
    _fit(fresh, epochs=1)
    assert_weights_close(fresh.get_weights(), expected)


def test_checkpoint_restores_onto_a_different_replica_count(tmp_path):
    # The accumulators are saved as their sum over replicas; a restore on
    # 4 replicas gives each a quarter, and the update is the same.
    from conftest import make_strategy

    expected = _uninterrupted(make_strategy("mirrored_2"))
    keras.backend.clear_session()
    with make_strategy("mirrored_2").scope():
        model = _compiled_model()
    _fit(model, epochs=1)
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt")
    )
    keras.backend.clear_session()
    with make_strategy("mirrored_4").scope():
        fresh = _compiled_model()
        fresh.optimizer.build(fresh.trainable_variables)
    tf.train.Checkpoint(model=fresh, optimizer=fresh.optimizer).restore(path)
    _assert_mid_window(fresh)
    _fit(fresh, epochs=1)
    assert_weights_close(fresh.get_weights(), expected)


class _InterruptAt(keras.callbacks.Callback):
    def __init__(self, epoch, batch):
        super().__init__()
        self.epoch, self.batch, self.current = epoch, batch, 0

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == self.batch:
            raise RuntimeError("simulated preemption")


@pytest.mark.parametrize("strategy_name", ["mirrored_2"])
def test_backup_and_restore_resumes_mid_window(strategy_name, tmp_path):
    from conftest import make_strategy

    strategy = make_strategy(strategy_name)
    expected = _uninterrupted(strategy)
    backup = str(tmp_path / "backup")
    keras.backend.clear_session()
    with strategy.scope():
        model = _compiled_model()
    with pytest.raises(RuntimeError, match="simulated preemption"):
        _fit(
            model,
            epochs=2,
            callbacks=[
                keras.callbacks.BackupAndRestore(backup),
                _InterruptAt(epoch=1, batch=5),
            ],
        )
    keras.backend.clear_session()
    with strategy.scope():
        resumed = _compiled_model()
    _fit(
        resumed, epochs=2, callbacks=[keras.callbacks.BackupAndRestore(backup)]
    )
    assert_weights_close(resumed.get_weights(), expected)
    assert int(resumed.optimizer.iterations.numpy()) == 5
    assert int(resumed.optimizer.micro_steps.numpy()) == 20

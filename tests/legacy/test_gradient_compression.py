"""GradientAccumulationOptimizer(compression=...) under tf_keras: bytes per
update under mirrored x2 (the inner optimizer's own all-reduce skipped with
`skip_gradients_aggregation`), resume with PowerSGD, config, bad input."""

from __future__ import annotations

import numpy as np
import pytest
from _training import max_abs_diff, mlp, regression_data
from conftest import make_strategy

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import IS_TF_KERAS, keras, tf
from keras_mgpu.compression import CrossDeviceByteCounter, PowerSGD

assert IS_TF_KERAS, "tests/legacy runs with TF_USE_LEGACY_KERAS=1"

# tests/_training.mlp: 6 -> 16 -> 16 -> 1.
PARAMETERS = 6 * 16 + 16 + 16 * 16 + 16 + 16 + 1
# PowerSGD rank 1: 6x16 and 16x16 as factors; 16x1 and biases as they are.
POWER_SGD_ELEMENTS = (6 + 16) + (16 + 16) + 16 + 16 + 16 + 1
X, Y = regression_data(64)


def _compile(strategy, compression, accumulation=2, learning_rate=0.05):
    with strategy.scope():
        model = mlp()
        model.compile(
            optimizer=GradientAccumulationOptimizer(
                keras.optimizers.SGD(learning_rate, momentum=0.9),
                accumulation,
                compression=compression,
            ),
            loss="mse",
        )
    return model


def _fit(model, start, stop):
    model.fit(
        X[start:stop], Y[start:stop], batch_size=8, shuffle=False, verbose=0
    )


@pytest.fixture(scope="module")
def runs():
    strategy = make_strategy("mirrored_2")
    results = {}
    for name, method in (
        ("float32", None),
        ("float16", "float16"),
        ("power_sgd", PowerSGD(rank=1, start_after_updates=0)),
    ):
        counter = CrossDeviceByteCounter(strategy)
        model = _compile(strategy, method)
        _fit(model, 0, 16)  # traces; the first update
        counter.reset()
        _fit(model, 16, 48)  # 2 updates
        results[name] = {
            "records": counter.records(),
            "weights": model.get_weights(),
        }
        counter.remove()
    return results


def _gradient_bytes(records, dtype) -> dict:
    return {
        r["shape"]: r["bytes"]
        for r in records
        if r["dtype"] == dtype and r["shape"]
    }


def test_float16_sends_half_of_every_gradient(runs):
    plain = _gradient_bytes(runs["float32"]["records"], "float32")
    half = _gradient_bytes(runs["float16"]["records"], "float16")
    assert sum(plain.values()) == 2 * 4 * PARAMETERS
    assert {shape: 2 * size for shape, size in half.items()} == plain
    assert (
        max_abs_diff(runs["float16"]["weights"], runs["float32"]["weights"])
        < 1e-4
    )


def test_power_sgd_sends_the_factors_only(runs):
    records = runs["power_sgd"]["records"]
    # 2 updates; nothing else crosses (no uncompressed all-reduce left in
    # the inner optimizer, no flag: finiteness is read on reduced values).
    assert sum(r["bytes"] for r in records) == 2 * 4 * POWER_SGD_ELEMENTS
    assert all(r["dtype"] == "float32" for r in records)


def _residual_total(optimizer) -> float:
    return sum(
        float(np.abs(state[0].numpy()).sum())
        for state in optimizer._compression_states
        if state
    )


def test_resume_mid_window_with_power_sgd(tmp_path):
    strategy = make_strategy("mirrored_2")
    method = PowerSGD(rank=1, start_after_updates=0)
    uninterrupted = _compile(strategy, method)
    _fit(uninterrupted, 0, 64)
    model = _compile(strategy, method)
    _fit(model, 0, 40)  # 5 micro-steps: 2 updates, 1 pending
    assert int(model.optimizer.pending_steps.numpy()) == 1
    total = _residual_total(model.optimizer)
    assert total > 0
    path = tf.train.Checkpoint(model=model, optimizer=model.optimizer).save(
        str(tmp_path / "ckpt")
    )
    model.save(str(tmp_path / "model.keras"))

    from_ckpt = _compile(strategy, method)
    with strategy.scope():
        from_ckpt.optimizer.build(from_ckpt.trainable_variables)
    tf.train.Checkpoint(model=from_ckpt, optimizer=from_ckpt.optimizer).restore(
        path
    ).assert_consumed()
    with strategy.scope():
        from_file = keras.models.load_model(str(tmp_path / "model.keras"))
    for restored in (from_ckpt, from_file):
        assert restored.optimizer.compression == method
        assert _residual_total(restored.optimizer) == pytest.approx(total)
        _fit(restored, 40, 64)
        assert (
            max_abs_diff(restored.get_weights(), uninterrupted.get_weights())
            < 1e-6
        )


@pytest.mark.parametrize(
    "method", [None, "bfloat16", PowerSGD(rank=2, start_after_updates=0)]
)
def test_config_round_trip(method):
    optimizer = GradientAccumulationOptimizer(
        keras.optimizers.SGD(0.1), 2, compression=method
    )
    restored = GradientAccumulationOptimizer.from_config(optimizer.get_config())
    assert restored.compression == optimizer.compression


def test_bad_input():
    with pytest.raises(ValueError, match=r"Received: compression='int8'"):
        GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1), 2, compression="int8"
        )
    with make_strategy("central_storage").scope():
        with pytest.raises(ValueError, match=r"CentralStorageStrategy"):
            GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.1), 2, compression="float16"
            )

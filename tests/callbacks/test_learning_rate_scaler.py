"""LearningRateScaler: factor from the strategy and accumulation in use,
applied in-graph, composing with ReduceLROnPlateau and warmup."""

from __future__ import annotations

import numpy as np
import pytest
from _processes import run_workers
from callbacks._lr_argument_cases import SCALER_BAD_INPUT
from callbacks.lr_mw_bodies import (
    RecordingSGD,
    data,
    expected_warmup,
    tiny_model,
)

import keras_mgpu
from keras_mgpu._flavour import keras
from keras_mgpu.callbacks import LearningRateScaler, LearningRateWarmup


def test_scales_from_strategy_and_accumulation(strategy, strategy_name):
    rule = "sqrt" if strategy_name in ("one_device", "mirrored_4") else "linear"
    replicas = strategy.num_replicas_in_sync
    accumulation = 2
    per_replica = 2
    with strategy.scope():
        model = tiny_model()
        inner = RecordingSGD(0.1)
        model.compile(
            optimizer=keras_mgpu.GradientAccumulationOptimizer(
                inner, accumulation
            ),
            loss="mse",
        )
    scaler = LearningRateScaler(
        base_batch_size=2,
        per_replica_batch_size=per_replica,
        scaling_rule=rule,
    )
    x, y = data(8, per_replica * replicas)
    history = model.fit(
        x,
        y,
        batch_size=per_replica * replicas,
        epochs=2,
        verbose=0,
        callbacks=[scaler],
    )
    ratio = replicas * accumulation
    factor = ratio if rule == "linear" else np.sqrt(ratio)
    assert scaler.global_batch_size == per_replica * ratio
    assert scaler.factor == pytest.approx(factor)
    np.testing.assert_allclose(inner.recorded(), 0.1 * factor, rtol=1e-6)
    assert history.history["learning_rate"] == pytest.approx([0.1 * factor] * 2)
    # The variable kept the base rate: config and checkpoints are clean.
    assert inner.get_config()["learning_rate"] == pytest.approx(0.1)


def test_composes_with_reduce_on_plateau_and_warmup(caplog):
    """ReduceLROnPlateau reads the scaled rate and writes a scaled rate."""
    model = tiny_model()
    inner = RecordingSGD(0.1)
    model.compile(optimizer=inner, loss="mse", steps_per_execution=2)
    x, y = data(4, 4)
    plateau = keras.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=0, min_delta=1e9, min_lr=0.0
    )
    with caplog.at_level("INFO", logger="keras_mgpu"):
        history = model.fit(
            x,
            y,
            batch_size=4,
            epochs=3,
            verbose=0,
            callbacks=[
                LearningRateScaler(base_batch_size=2, batch_size=4),
                LearningRateWarmup(warmup_steps=2),
                plateau,
            ],
        )
    assert caplog.text.count("learning rate x 2 (linear rule)") == 1
    # Scaled to 0.2; the plateau halves it from the end of epoch 1 on (the
    # first epoch always counts as an improvement).
    targets = [0.2, 0.2, 0.1]
    expected = [
        expected_warmup(n, 2, 0.0, targets[n // 4], "linear") for n in range(12)
    ]
    np.testing.assert_allclose(inner.recorded(), expected, rtol=1e-5)
    assert history.history["learning_rate"] == pytest.approx(
        [0.2, 0.2, 0.1]  # Keras logs the rate before its reduction
    )
    # Base variable: the plateau's reductions divided by the factor.
    assert float(inner._learning_rate.numpy()) == pytest.approx(0.025)


def test_needs_batch_size():
    model = tiny_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data(2, 4)
    with pytest.raises(ValueError, match=r"LearningRateScaler needs the"):
        model.fit(
            x,
            y,
            batch_size=4,
            verbose=0,
            callbacks=[LearningRateScaler(base_batch_size=4)],
        )


@pytest.mark.parametrize("kwargs, error, match", SCALER_BAD_INPUT)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        LearningRateScaler(**kwargs)


@pytest.mark.slow
def test_two_workers_custom_loop():
    """MultiWorkerMirrored x2 (custom loop: Keras 3.15 fit fails there)."""
    results = run_workers("callbacks.lr_mw_bodies:train_body", 2, timeout=150)
    for result in results:
        assert result["replicas"] == 2
        assert result["factor"] == pytest.approx(2.0)
        expected = [expected_warmup(n, 4, 0.0, 0.2, "cosine") for n in range(6)]
        np.testing.assert_allclose(result["recorded"], expected, rtol=1e-5)
        assert result["logs_lr"] == pytest.approx(0.2)
        assert result["config_lr"] == pytest.approx(0.1)
    assert results[0]["recorded"] == results[1]["recorded"]


def test_renamed_rule_and_keras_verbose_default():
    from keras_mgpu.callbacks import LearningRateScaler

    assert LearningRateScaler(base_batch_size=8).verbose == 0  # as Keras
    with pytest.warns(FutureWarning, match="use `scaling_rule` instead"):
        scaler = LearningRateScaler(base_batch_size=8, rule="sqrt")
    assert scaler.scaling_rule == "sqrt"

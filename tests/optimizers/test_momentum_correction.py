"""GradientAccumulationOptimizer(momentum_correction=True): Goyal et al.'s
momentum correction, against the closed form under the strategy matrix."""

from __future__ import annotations

import numpy as np
import pytest
from _momentum_correction import UPDATES, schedule, train

from keras_mgpu._flavour import keras
from keras_mgpu.optimizers import GradientAccumulationOptimizer


@pytest.mark.parametrize(
    "accumulation, nesterov",
    [(1, False), (3, True)],
    ids=["no_accumulation-heavy_ball", "accumulation_3-nesterov"],
)
def test_matches_rate_free_momentum(strategy, accumulation, nesterov):
    weights, expected, optimizer = train(
        strategy, accumulation, correction=True, nesterov=nesterov
    )
    np.testing.assert_allclose(weights, expected, rtol=2e-5, atol=2e-6)
    assert int(optimizer.iterations.numpy()) == UPDATES
    # The rate of the last update is kept for the next one (checkpointed).
    assert float(optimizer.previous_learning_rate.numpy()) == pytest.approx(
        float(schedule()(UPDATES - 1))
    )


def test_without_correction_the_old_rate_lingers(strategy):
    # The same run without the correction is measurably different: the
    # closed form above is the corrected method, not plain Keras SGD.
    weights, expected, optimizer = train(
        strategy, 1, correction=False, nesterov=False
    )
    assert np.max(np.abs(weights - expected)) > 1e-3
    assert optimizer.previous_learning_rate is None


def test_config_round_trip():
    optimizer = GradientAccumulationOptimizer(
        keras.optimizers.SGD(0.1, momentum=0.9), 2, momentum_correction=True
    )
    config = optimizer.get_config()
    assert config["momentum_correction"] is True
    restored = GradientAccumulationOptimizer.from_config(config)
    assert restored.momentum_correction is True


def test_bad_arguments():
    with pytest.raises(TypeError, match=r"momentum_correction='yes'"):
        GradientAccumulationOptimizer(
            keras.optimizers.SGD(momentum=0.9), 2, momentum_correction="yes"
        )
    with pytest.raises(
        ValueError, match=r"needs an SGD inner optimizer.*inner_optimizer=Adam"
    ):
        GradientAccumulationOptimizer(
            keras.optimizers.Adam(), 2, momentum_correction=True
        )
    with pytest.raises(ValueError, match=r"SGD\(momentum=0.0\)"):
        GradientAccumulationOptimizer(
            keras.optimizers.SGD(), 2, momentum_correction=True
        )

"""Scaling rules on each backend: closed form, and the global batch of one
update from the strategy (TensorFlow) or `keras.distribution` (JAX) in force
and the optimizer's accumulation; bad input."""

from __future__ import annotations

import math
import re

import pytest

import keras_mgpu
from keras_mgpu._flavour import keras
from keras_mgpu.schedules import scaled_learning_rate, scaling_factor
from keras_mgpu.testing.strategies import devices_needed

pytestmark = pytest.mark.backends("tensorflow", "jax")

# (kwargs, error, match) for `scaled_learning_rate`.
SCALING_BAD_INPUT = [
    (
        {"scaling_rule": "cubic"},
        ValueError,
        r"Argument `scaling_rule` must be one of 'linear', 'sqrt'\. "
        r"Received: scaling_rule='cubic'",
    ),
    (
        {"base_batch_size": 0},
        ValueError,
        r"`base_batch_size` must be an integer >= 1\. "
        r"Received: base_batch_size=0",
    ),
    (
        {"global_batch_size": 8.0},
        TypeError,
        r"`global_batch_size` must be an integer >= 1",
    ),
    (
        {"base_learning_rate": -0.1},
        ValueError,
        r"`base_learning_rate` must be a number > 0\.0\. "
        r"Received: base_learning_rate=-0\.1",
    ),
]


@pytest.mark.parametrize(
    "rule, expected", [("linear", 0.1 * 4), ("sqrt", 0.1 * 2)]
)
def test_rules_closed_form(rule, expected):
    assert scaled_learning_rate(
        0.1, 1024, 256, scaling_rule=rule
    ) == pytest.approx(expected, rel=1e-12)
    assert scaling_factor(128, 256, scaling_rule=rule) == pytest.approx(
        0.5 if rule == "linear" else math.sqrt(0.5)
    )


def _replicas_of(strategy_name: str) -> int:
    """Data-parallel replicas of a matrix entry, from its name: a
    `model_parallel_<b>x<m>` mesh has b, the others one per device."""
    match = re.match(r"model_parallel_(\d+)x\d+$", strategy_name)
    return int(match.group(1)) if match else devices_needed(strategy_name)


def test_global_batch_from_strategy_and_accumulation(strategy, strategy_name):
    with strategy.scope():
        wrapped = keras_mgpu.GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1), accumulation_steps=4
        )
        builtin = keras.optimizers.SGD(0.1, gradient_accumulation_steps=3)
        replicas = keras_mgpu.num_replicas_in_sync()
        batches = [
            keras_mgpu.global_batch_size(8, accumulation_steps=optimizer)
            for optimizer in (wrapped, builtin)
        ]
    assert replicas == _replicas_of(strategy_name)
    assert batches == [8 * replicas * 4, 8 * replicas * 3]
    lr = scaled_learning_rate(0.1, batches[0], base_batch_size=32)
    assert lr == pytest.approx(0.1 * replicas)


@pytest.mark.parametrize("kwargs, error, match", SCALING_BAD_INPUT)
def test_bad_input(kwargs, error, match):
    arguments = {
        "base_learning_rate": 0.1,
        "global_batch_size": 64,
        "base_batch_size": 32,
        "scaling_rule": "linear",
        **kwargs,
    }
    with pytest.raises(error, match=match):
        scaled_learning_rate(**arguments)


def test_the_old_name_rule_still_works_with_a_future_warning():
    with pytest.warns(FutureWarning, match="`rule` is deprecated.*0.3.0"):
        assert scaled_learning_rate(0.1, 1024, 256, rule="sqrt") == (
            pytest.approx(0.2)
        )
    with pytest.raises(TypeError, match="both `scaling_rule` and .*`rule`"):
        scaling_factor(4, 2, scaling_rule="sqrt", rule="linear")
    with pytest.raises(TypeError, match="unexpected keyword argument 'rul'"):
        scaling_factor(4, 2, rul="sqrt")

"""Scaling rules: closed form, global batch from strategy and accumulation."""

from __future__ import annotations

import math

import pytest
from schedules._argument_cases import SCALING_BAD_INPUT

import keras_mgpu
from keras_mgpu._flavour import keras
from keras_mgpu.schedules import scaled_learning_rate, scaling_factor


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


def test_global_batch_from_strategy_and_accumulation(strategy):
    with strategy.scope():
        optimizer = keras_mgpu.GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1), accumulation_steps=4
        )
        batch = keras_mgpu.global_batch_size(8, accumulation_steps=optimizer)
    assert batch == 8 * strategy.num_replicas_in_sync * 4
    lr = scaled_learning_rate(0.1, batch, base_batch_size=32)
    assert lr == pytest.approx(0.1 * strategy.num_replicas_in_sync)


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

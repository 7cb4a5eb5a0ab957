"""Scaling rules on JAX: closed form, and the global batch of one update
from the keras.distribution in force and the optimizer's accumulation."""

from __future__ import annotations

import math

import keras
import pytest
from callbacks.lr_jax_helpers import (
    StandInAccumulation,
    make_distribution,
    replicas_of,
    scope,
)
from schedules._argument_cases import SCALING_BAD_INPUT

import keras_mgpu
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


@pytest.mark.parametrize("name", ["none", "data_parallel", "model_parallel"])
def test_global_batch_from_distribution_and_accumulation(name):
    with scope(make_distribution(name)):
        builtin = keras.optimizers.SGD(0.1, gradient_accumulation_steps=4)
        wrapped = StandInAccumulation(
            keras.optimizers.SGD(0.1, gradient_accumulation_steps=3)
        )
        replicas = keras_mgpu.num_replicas_in_sync()
        batches = [
            keras_mgpu.global_batch_size(8, accumulation_steps=optimizer)
            for optimizer in (builtin, wrapped)
        ]
    assert replicas == replicas_of(name)
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

"""A MultiOptimizer inside GradientAccumulationOptimizer with Keras's LR
callbacks, on TensorFlow (bodies shared with JAX:
`multi_optimizer_bodies.py`)."""

from __future__ import annotations

from multi_optimizer_bodies import (
    check_callbacks_set_the_sub_optimizers_rates,
    check_fit_with_a_schedule_equals_the_large_batch,
)


def test_callbacks_set_the_sub_optimizers_rates():
    check_callbacks_set_the_sub_optimizers_rates()


def test_fit_with_a_schedule_equals_the_large_batch():
    check_fit_with_a_schedule_equals_the_large_batch()

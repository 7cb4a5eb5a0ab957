"""Helpers for the learning-rate tests on JAX (no TensorFlow).

`RecordingSGD` writes the learning rate each update received inside the
jitted train step (the `learning_rate` argument of `update_step`) at index
`iterations` of an optimizer variable: the tests read the rate of *every*
update, inside `steps_per_execution`, under a distribution and across a
resume. `StandInAccumulation` stands for keras_mgpu's
`GradientAccumulationOptimizer` (ported in parallel): a wrapper with
`accumulation_steps` and an `inner_optimizer` whose `iterations` counts
updates (here Keras's built-in accumulation does the accumulating).
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops

LOG_SIZE = 64
FEATURES = 3


@keras.saving.register_keras_serializable(package="keras_mgpu_tests")
class RecordingSGD(keras.optimizers.SGD):
    """Plain SGD that logs the learning rate of every update."""

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self.lr_log = self.add_variable(
            shape=(LOG_SIZE,),
            initializer="zeros",
            dtype="float32",
            name="lr_log",
        )

    def update_step(self, gradient, variable, learning_rate):
        super().update_step(gradient, variable, learning_rate)
        # Runs before `iterations` is incremented: index n is update n.
        # Every variable writes the same value at the same index.
        index = ops.cast(self.iterations, "int32")
        lr = ops.cast(learning_rate, "float32")
        self.lr_log.assign(
            ops.where(ops.arange(LOG_SIZE) == index, lr, self.lr_log.value)
        )

    def recorded(self) -> np.ndarray:
        done = int(ops.convert_to_numpy(self.iterations))
        return np.asarray(ops.convert_to_numpy(self.lr_log))[:done]


class StandInAccumulation(keras.optimizers.LossScaleOptimizer):
    """A wrapper optimizer with the attributes keras_mgpu reads from
    `GradientAccumulationOptimizer`: `accumulation_steps`, and
    `inner_optimizer` (which holds the learning rate and whose
    `iterations` counts updates)."""

    def __init__(self, inner, **kwargs):
        super().__init__(inner, **kwargs)
        self.accumulation_steps = inner.gradient_accumulation_steps


def expected_warmup(n, warmup, initial, target, ramp):
    """Closed form of a ramp to `target` at update `n` (target from W on)."""
    if n >= warmup:
        return target
    fraction = n / warmup
    if ramp == "linear":
        return initial + (target - initial) * fraction
    if ramp == "cosine":
        return initial + (target - initial) * 0.5 * (
            1 - math.cos(math.pi * fraction)
        )
    return initial * (target / initial) ** fraction


def data(batches: int, batch_size: int):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(batches * batch_size, FEATURES)).astype("float32")
    y = rng.normal(size=(batches * batch_size, 1)).astype("float32")
    return x, y


def tiny_model():
    """Dense(4) -> Dense(1): both kernels shard on a 2-way model axis."""
    # Seeded initializers: `keras.utils.set_random_seed` imports TensorFlow.
    return keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(4, name="hidden", kernel_initializer=_glorot(3)),
            keras.layers.Dense(1, name="out", kernel_initializer=_glorot(4)),
        ]
    )


def _glorot(seed):
    return keras.initializers.GlorotUniform(seed=seed)


def make_distribution(name: str):
    """None, DataParallel on the 4 CPU devices, or ModelParallel on a
    2 (batch) x 2 (model) mesh with both kernels split on "model"."""
    if name == "none":
        return None
    devices = keras.distribution.list_devices("cpu")
    if name == "data_parallel":
        return keras.distribution.DataParallel(devices=devices)
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ["batch", "model"], devices=devices
    )
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["hidden/kernel"] = (None, "model")
    layout_map["out/kernel"] = ("model", None)
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def replicas_of(name: str) -> int:
    return {"none": 1, "data_parallel": 4, "model_parallel": 2}[name]


class _NoScope:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def scope(distribution):
    """`distribution.scope()`, or nothing for no distribution."""
    return _NoScope() if distribution is None else distribution.scope()

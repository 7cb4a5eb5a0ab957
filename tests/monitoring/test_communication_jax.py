"""The compiled train step's collectives on JAX (4 CPU devices): the bytes
its gradient reduction sends equal the gradients' bytes exactly, under
`DataParallel` and, per device, under `ModelParallel`."""

from __future__ import annotations

import keras
import pytest
from monitoring import _communication_cases as cases

import keras_mgpu
from keras_mgpu.backend.jax.collectives import (
    collectives_from_hlo,
    compiled_train_step,
)
from keras_mgpu.monitoring import train_step_collectives, update_bytes


def test_data_parallel_reduces_exactly_the_gradients_bytes():
    distribution = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices("cpu")
    )
    x, y = cases.batch()
    with distribution.scope():
        model = cases.build_model(keras, metrics=["mae"])
        with pytest.raises(ValueError, match="`model` must be compiled and"):
            train_step_collectives(model, x, y)
        model.train_on_batch(x, y)
        counts = train_step_collectives(model, x, y)
        traffic = update_bytes(model)
    expected = cases.float32_bytes()
    assert traffic.bytes_per_update == expected
    # XLA combines the reductions into one tuple all-reduce on CPU: the
    # gradients plus the loss's and the metric's scalar sums.
    assert counts["all-reduce"] - counts["scalar"] == expected
    assert 0 < counts["scalar"] <= 4 * 4
    assert counts["total"] == counts["all-reduce"]
    assert counts["wire"] == pytest.approx(2 * 3 / 4 * counts["all-reduce"])


def test_model_parallel_reduces_each_devices_shard_over_the_data_axis():
    devices = keras.distribution.list_devices("cpu")
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map[".*d1/kernel"] = (None, "model")
    layout_map[".*d1/bias"] = ("model",)
    layout_map[".*d2/kernel"] = ("model", None)
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )
    x, y = cases.batch()
    with distribution.scope():
        model = cases.build_model(keras)
        model.train_on_batch(x, y)
        compiled = compiled_train_step(model, x, y)
        traffic = update_bytes(model)
    # Each device holds half of d1's kernel and bias and of d2's kernel.
    expected = cases.float32_bytes([(8, 8), (8,), (8, 3), (3,)])
    assert traffic.bytes_per_update == expected
    records = collectives_from_hlo(compiled.as_text())
    over_data = [r for r in records if r.mesh_axes == (0,)]
    assert over_data, [r for r in records]
    assert all(r.group_size == 2 for r in over_data)
    assert sum(r.bytes - r.scalar_bytes for r in over_data) == expected
    # The model axis carries the activations' partial sums besides.
    assert any(r.mesh_axes != (0,) for r in records)


def test_accumulation_reduces_every_micro_step_on_jax():
    distribution = keras.distribution.DataParallel(
        devices=keras.distribution.list_devices("cpu")
    )
    x, y = cases.batch()
    with distribution.scope():
        optimizer = keras_mgpu.GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.1), accumulation_steps=4
        )
        model = cases.build_model(keras, optimizer=optimizer)
        model.train_on_batch(x, y)
        counts = train_step_collectives(model, x, y)
        traffic = update_bytes(model)
    # Each `fit` step (one micro-step) is a compiled call that reduces its
    # gradients once: 4 reductions per update.
    assert counts["all-reduce"] - counts["scalar"] == cases.float32_bytes()
    assert traffic.payload_bytes == cases.float32_bytes()
    assert traffic.reductions_per_update == 4
    assert traffic.bytes_per_update == 4 * cases.float32_bytes()

"""`shard_optimizer_state`: the optimizer's state split over the data axis
(ZeRO-1, and the accumulators of ZeRO-2), trained against the unsharded
model (`assert_trains_like`), its bytes per device read from the shards,
saved and loaded, and refused on TensorFlow."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _layout_models import mesh, mlp

import keras_mgpu
from keras_mgpu.backend import BackendNotSupportedError
from keras_mgpu.sharding import (
    check_layout_map,
    copy_into_shards,
    on_host,
    plan_layout_map,
    shard_optimizer_state,
)

pytestmark = pytest.mark.backends("tensorflow", "jax")


def _data(samples=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 32)).astype("float32")
    y = rng.normal(size=(samples, 4)).astype("float32")
    return x, y


def _compiled(optimizer_fn):
    def build():
        model = mlp()
        model.compile(optimizer_fn(), "mse")
        if keras.distribution.distribution() is not None:
            shard_optimizer_state(model)
        return model

    return build


def _state_specs(model) -> dict:
    return {
        v.path: tuple(v.value.sharding.spec)
        for v in model.optimizer.variables
        if len(v.shape)
    }


def _fit_weights(distribution, optimizer_fn, shard: bool):
    """Weights after one epoch under `distribution`, the state split or
    not (the same seed, so the same initial weights)."""
    keras_mgpu.testing.set_random_seed(0)
    with distribution.scope():
        model = mlp()
        model.compile(optimizer_fn(), "mse")
        report = shard_optimizer_state(model) if shard else None
        model.fit(*_data(), batch_size=16, epochs=1, shuffle=False, verbose=0)
    return model, report, [np.array(w) for w in model.get_weights()]


def _split_trains_as_whole(distribution, optimizer_fn):
    """The state split trains like one device (to 1e-5: Adam's division by
    sqrt(v) lifts the all-reduce's rounding to ~4e-6 on a few weights) and
    like the same distribution with the state whole (to 1e-6); the split
    model and its report."""
    keras_mgpu.testing.assert_trains_like(
        _compiled(optimizer_fn), _data(), distribution, steps=4, atol=1e-5
    )
    _, _, whole = _fit_weights(distribution, optimizer_fn, shard=False)
    model, report, split = _fit_weights(distribution, optimizer_fn, shard=True)
    for want, got in zip(whole, split, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7)
    return model, report


@pytest.mark.backends("jax")
def test_adam_state_split_over_data_parallel_trains_like_unsharded():
    distribution = keras.distribution.DataParallel()

    def adam():
        return keras.optimizers.Adam(0.01)

    model, report = _split_trains_as_whole(distribution, adam)
    # Every moment of a kernel or bias of 4 KiB or more is split along the
    # batch axis; the step counter and learning rate are not.
    assert report.axis == "batch" and report.axis_size == 4
    assert any(p.endswith("/iteration") for p in report.replicated)
    assert all("batch" in axes for axes in report.sharded.values())
    assert len(report.sharded) == 2 * 4  # up/down kernels: m and v
    # Still split after fit (the step keeps the state where it lies), and
    # the state per device a quarter of the moments' bytes plus the rest.
    specs = _state_specs(model)
    for path in report.sharded:
        assert "batch" in specs[path], path
    moments = sum(
        int(np.prod(v.shape)) * 4
        for v in model.optimizer.variables
        if v.path in report.sharded
    )
    rest = report.bytes_per_device_before - moments
    assert report.bytes_per_device_after == moments // 4 + rest
    assert str(report).startswith("optimizer state over 'batch' (4 devices)")


@pytest.mark.backends("jax")
def test_model_parallel_split_kept_and_accumulators_and_ema_split_too():
    """On a (2, 2) mesh planned along the model axis only, the state keeps
    its weight's model split and takes the batch axis on another dimension;
    `GradientAccumulationOptimizer`'s accumulators and EMA averages are
    optimizer variables and are split alike. Trains like unsharded."""
    layout_map = plan_layout_map(mlp(), mesh((2, 2)), policy="model")
    distribution = keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )

    def optimizer():
        return keras_mgpu.GradientAccumulationOptimizer(
            keras.optimizers.Adam(0.01, use_ema=True), 2
        )

    model, _ = _split_trains_as_whole(distribution, optimizer)
    specs = _state_specs(model)
    kernel = [p for p in specs if p.endswith("up_0_kernel_accumulator")]
    assert kernel and set(specs[kernel[0]]) == {"batch", "model"}
    averages = [p for p in specs if "up_0_kernel" in p and "average" in p]
    assert averages
    for path in averages:
        assert set(specs[path]) == {"batch", "model"}, path
    report = check_layout_map(model, layout_map, optimizer=model.optimizer)
    assert report.measured_optimizer_bytes_per_device is not None
    assert report.measured_optimizer_bytes_per_device < (
        report.optimizer_bytes_per_device
    )


@pytest.mark.backends("jax")
def test_saved_state_loads_into_the_shards_and_resumes_exactly(tmp_path):
    x, y = _data()
    distribution = keras.distribution.DataParallel()
    path = str(tmp_path / "model.keras")
    with distribution.scope():
        model = _compiled(lambda: keras.optimizers.Adam(0.01))()
        model.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
        model.save(path)
        loaded = keras.models.load_model(path)
        shard_optimizer_state(loaded)
        for a, b in zip(
            model.optimizer.variables, loaded.optimizer.variables, strict=True
        ):
            np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
        assert _state_specs(loaded) == _state_specs(model)
        for m in (model, loaded):
            m.fit(x, y, batch_size=16, epochs=1, shuffle=False, verbose=0)
    for a, b in zip(model.get_weights(), loaded.get_weights(), strict=True):
        np.testing.assert_array_equal(b, a)


@pytest.mark.backends("jax")
def test_bad_arguments():
    model = mlp()
    with pytest.raises(ValueError, match="compiled with an optimizer"):
        shard_optimizer_state(model)
    model.compile(keras.optimizers.Adam(), "mse")
    with pytest.raises(ValueError, match="Received: no distribution"):
        shard_optimizer_state(model)
    with keras.distribution.DataParallel().scope():
        with pytest.raises(ValueError, match="Received: axis='model'"):
            shard_optimizer_state(model, axis="model")
        with pytest.raises(ValueError, match="min_shard_bytes"):
            shard_optimizer_state(model, min_shard_bytes=-1)
    with pytest.raises(TypeError, match="built Keras model"):
        shard_optimizer_state("model")


@pytest.mark.backends("tensorflow")
def test_tensorflow_refuses_naming_what_to_use():
    model = mlp()
    model.compile(keras.optimizers.Adam(), "mse")
    for call in (
        lambda: shard_optimizer_state(model),
        lambda: plan_layout_map(model, None),
        lambda: on_host(mlp),
        lambda: copy_into_shards(model, model),
    ):
        with pytest.raises(BackendNotSupportedError, match="apply_placement"):
            call()

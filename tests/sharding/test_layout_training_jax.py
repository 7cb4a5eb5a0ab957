"""A planned layout map in `fit`: it trains like the unsharded model
(`assert_trains_like`), and composes with `GradientAccumulationOptimizer`
(accumulators laid out like their variables), in-place recompute and
`MemoryMonitor`."""

from __future__ import annotations

import keras
import numpy as np
import pytest
from _layout_models import mesh, mlp

import keras_mgpu
from keras_mgpu.callbacks import MemoryMonitor
from keras_mgpu.sharding import check_layout_map, plan_layout_map
from keras_mgpu.testing import assert_trains_like, set_random_seed


def _data(samples=64):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 32)).astype("float32")
    y = rng.normal(size=(samples, 4)).astype("float32")
    return x, y


def _distribution(shape=(2, 2)):
    layout_map = plan_layout_map(mlp(), mesh(shape))
    return keras.distribution.ModelParallel(
        layout_map=layout_map, batch_dim_name="batch"
    )


def _compiled_mlp():
    model = mlp()
    model.compile(keras.optimizers.SGD(0.05, momentum=0.9), "mse")
    return model


@pytest.mark.slow
def test_sharded_fit_trains_like_unsharded():
    differences = assert_trains_like(
        _compiled_mlp,
        _data(),
        _distribution((2, 2)),
        steps=4,
        rtol=1e-5,
        atol=1e-6,
    )
    assert set(differences) >= {"up_0/kernel", "down_1/kernel"}


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:MemoryMonitor:UserWarning")
def test_accumulation_recompute_and_monitor_under_the_plan():
    """K=2 micro-batches of 16 with recompute and a monitor, sharded, end
    where plain sharded SGD at batch 32 does; the accumulators live where
    their variables do."""
    x, y = _data()
    distribution = _distribution((1, 4))
    weights = []
    for together in (False, True):
        keras.backend.clear_session()
        set_random_seed(0)
        with distribution.scope():
            model = mlp()
            optimizer = keras.optimizers.SGD(0.05, momentum=0.9)
            callbacks = []
            if together:
                keras_mgpu.apply_recompute(model)
                optimizer = keras_mgpu.GradientAccumulationOptimizer(
                    optimizer, 2
                )
                callbacks = [MemoryMonitor()]
            model.compile(optimizer, "mse")
            model.fit(
                x,
                y,
                batch_size=16 if together else 32,
                epochs=1,
                shuffle=False,
                verbose=0,
                callbacks=callbacks,
            )
        weights.append([np.array(w) for w in model.get_weights()])
    for want, got in zip(*weights):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    report = check_layout_map(
        model, distribution._layout_map, optimizer=model.optimizer
    )
    assert report.measured_param_bytes_per_device == (
        report.param_bytes_per_device
    )
    for variable, accumulator in zip(
        model.trainable_variables, optimizer._accumulators
    ):
        assert accumulator.value.sharding.is_equivalent_to(
            variable.value.sharding, len(variable.shape)
        ), variable.path
    kernel = model.get_layer("up_0").kernel
    assert tuple(kernel.value.sharding.spec) == (None, "model")

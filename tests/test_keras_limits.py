"""Limits of Keras 3 itself on TensorFlow, one test per row of the README's
compatibility table.

None of these uses a keras_mgpu component: each asserts that plain Keras
still fails (or is still wrong) the way it was measured, so that a Keras
release fixing it makes the test fail and we update the table.
"""

from __future__ import annotations

import numpy as np
import pytest
from _processes import run_in_process, run_workers
from _training import mlp, regression_data
from conftest import make_strategy

from keras_mgpu._flavour import keras

pytestmark = pytest.mark.keras_limit


def _fit_plain(strategy, optimizer="sgd", model=None, epochs=1, **compile_kw):
    x, y = regression_data(32)
    with strategy.scope():
        model = model() if model else mlp()
        model.compile(optimizer=optimizer, loss="mse", **compile_kw)
    return model, model.fit(
        x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0
    )


def test_builtin_gradient_accumulation_fails_under_mirrored():
    strategy = make_strategy("mirrored_2")
    with pytest.raises(Exception, match="merge_call"):
        with strategy.scope():
            optimizer = keras.optimizers.SGD(gradient_accumulation_steps=2)
        _fit_plain(strategy, optimizer=optimizer)


def test_builtin_gradient_accumulation_schedules_count_micro_steps():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay(
        [2], [0.1, 0.01]
    )
    optimizer = keras.optimizers.SGD(schedule, gradient_accumulation_steps=4)
    model, _ = _fit_plain(make_strategy("default"), optimizer=optimizer)
    # 4 micro-steps = 1 update, yet the schedule already moved past step 2.
    assert int(optimizer.iterations.numpy()) == 1
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(0.01)


@pytest.mark.slow
def test_steps_per_execution_fails_under_mirrored_with_collective_ops():
    # With ReductionToOneDevice it runs (the wrapper is tested there in
    # tests/optimizers); with the default CollectiveAllReduce plain Keras
    # fails deep in its multi-step loop, and our wrapper says why upfront.
    result = run_in_process(
        "keras_limits_bodies:mirrored_steps_per_execution", timeout=180
    )
    assert "must feed a value for placeholder" in result["plain"]
    assert (
        "ValueError: steps_per_execution > 1 under MirroredStrategy"
        in (result["wrapper"])
    )


def test_jit_compile_fails_under_mirrored_on_cpu():
    with pytest.raises(Exception, match="resource|device"):
        _fit_plain(make_strategy("mirrored_2"), jit_compile=True)


def test_dropout_fails_under_central_storage():
    def with_dropout():
        return keras.Sequential(
            [
                keras.Input((6,)),
                keras.layers.Dense(4),
                keras.layers.Dropout(0.5),
                keras.layers.Dense(1),
            ]
        )

    with pytest.raises(Exception, match="aggregation"):
        _fit_plain(make_strategy("central_storage"), model=with_dropout)


def test_central_storage_reports_a_wrong_loss_with_right_weights():
    _, one = _fit_plain(make_strategy("default"))
    model_cs, central = _fit_plain(make_strategy("central_storage"))
    model_one, _ = _fit_plain(make_strategy("default"))
    for a, b in zip(model_cs.get_weights(), model_one.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert central.history["loss"][0] != pytest.approx(
        one.history["loss"][0], rel=1e-3
    )


def test_clipping_is_per_replica_under_mirrored():
    def sgd():
        return keras.optimizers.SGD(0.5, global_clipnorm=0.05)

    one, _ = _fit_plain(make_strategy("default"), optimizer=sgd())
    four, _ = _fit_plain(make_strategy("mirrored_4"), optimizer=sgd())
    diff = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(one.get_weights(), four.get_weights())
    )
    assert diff > 1e-3


def test_mixed_precision_overflow_on_one_replica_gives_nan_weights():
    from optimizers.test_gradient_accumulation_distributed import (
        _fit_mixed_precision,
    )

    model = _fit_mixed_precision(make_strategy("mirrored_2"), None)
    assert any(np.any(~np.isfinite(w)) for w in model.get_weights())


def test_remat_scope_fails_in_fit():
    def remat_model():
        with keras.RematScope(mode="full"):
            return mlp()

    with pytest.raises(Exception, match="custom_gradient|keyword"):
        _fit_plain(make_strategy("default"), model=remat_model)


@pytest.mark.slow
def test_fit_fails_under_multi_worker_mirrored():
    results = run_workers("keras_limits_bodies:multi_worker_fit", timeout=180)
    for result in results:
        assert result["error"] is not None
        assert "PerReplica" in result["error"]


@pytest.mark.slow
def test_fit_fails_under_parameter_server():
    result = run_in_process(
        "keras_limits_bodies:parameter_server_fit", timeout=180
    )
    assert result["error"] is not None
    assert "create_per_worker_dataset" in result["error"] or (
        "ParameterServerStrategy" in result["error"]
    )


def test_apply_always_all_reduces_under_a_strategy():
    """Keras 3's `Optimizer.apply` sums the gradients it is given over the
    replicas (`_all_reduce_sum_gradients`), with no public switch such as
    tf_keras's `skip_gradients_aggregation`. GradientAccumulationOptimizer
    reduces (and compresses) the mean itself, so it shadows that private
    method while the inner optimizer's update is traced."""
    import inspect

    import tensorflow as tf

    from keras_mgpu.compression import CrossDeviceByteCounter

    parameters = inspect.signature(keras.optimizers.Optimizer.apply).parameters
    assert "skip_gradients_aggregation" not in parameters
    strategy = make_strategy("mirrored_2")
    counter = CrossDeviceByteCounter(strategy)
    with strategy.scope():
        variable = keras.Variable(np.zeros((3, 4), "float32"))
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build([variable])

    @tf.function
    def step():
        strategy.run(lambda: optimizer.apply([tf.ones((3, 4))], [variable]))

    step()
    counter.remove()
    assert counter.total_bytes() == 3 * 4 * 4
    np.testing.assert_allclose(variable.numpy(), -0.2)


def test_uneven_last_batch_is_weighted_per_replica():
    """Keras averages each replica's mean loss: a last batch of 9 split 5/4
    over 2 replicas weights each sample by its replica (MirroredStrategy;
    multi-worker the same, where enable_multi_worker_fit warns)."""

    def fit(name, samples):
        x, y = regression_data(samples)
        strategy = make_strategy(name)
        with strategy.scope():
            model = mlp()
            model.compile(optimizer=keras.optimizers.SGD(0.5), loss="mse")
        model.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
        return model.get_weights()

    uneven = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(fit("default", 57), fit("mirrored_2", 57))
    )
    even = max(
        float(np.max(np.abs(a - b)))
        for a, b in zip(fit("default", 64), fit("mirrored_2", 64))
    )
    assert even < 1e-5
    assert uneven > 1e-4

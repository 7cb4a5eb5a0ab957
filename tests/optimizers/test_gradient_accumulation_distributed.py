"""GradientAccumulationOptimizer across devices: communication, mixed
precision, real multi-worker processes, default cross-device ops."""

from __future__ import annotations

import numpy as np
import pytest
from _processes import run_in_process, run_workers
from _training import assert_weights_close, regression_data

from keras_mgpu import GradientAccumulationOptimizer
from keras_mgpu._flavour import keras, tf


class _CountingReduction(tf.distribute.ReductionToOneDevice):
    """ReductionToOneDevice that counts, at run time, the elements it
    reduces (an all-reduce inside an untaken `tf.cond` branch counts 0).

    Its batch_reduce calls reduce_implementation once per value, so
    counting there counts every reduced tensor once.
    """

    def __init__(self):
        super().__init__()
        with tf.device("/cpu:0"):
            self.elements = tf.Variable(0, dtype=tf.int64, trainable=False)
            self.calls = tf.Variable(0, dtype=tf.int64, trainable=False)

    def _count(self, values):
        size = sum(
            int(np.prod(v.values[0].shape)) if hasattr(v, "values") else 1
            for v in values
        )
        return [
            self.elements.assign_add(size),
            self.calls.assign_add(1),
        ]

    def reduce_implementation(self, reduce_op, value, destinations, options):
        with tf.control_dependencies(self._count([value])):
            return super().reduce_implementation(
                reduce_op, value, destinations, options
            )


def _count_reduced_elements(accumulation):
    ops = _CountingReduction()
    strategy = tf.distribute.MirroredStrategy(
        ["/cpu:0", "/cpu:1"], cross_device_ops=ops
    )
    x, y = regression_data(64, features=3)
    with strategy.scope():
        keras.utils.set_random_seed(1)
        layer = keras.layers.Dense(2)
        layer.build((None, 3))
        optimizer = keras.optimizers.SGD(0.1)
        if accumulation:
            optimizer = GradientAccumulationOptimizer(optimizer, accumulation)
    dataset = strategy.experimental_distribute_dataset(
        tf.data.Dataset.from_tensor_slices((x, y)).batch(8)
    )

    @tf.function
    def step(xb, yb):
        def replica(xr, yr):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((layer(xr) - yr) ** 2)
            grads = tape.gradient(loss, layer.trainable_variables)
            optimizer.apply(grads, layer.trainable_variables)

        strategy.run(replica, args=(xb, yb))

    for xb, yb in dataset:
        step(xb, yb)
    return int(ops.elements.numpy()), int(ops.calls.numpy())


def test_gradients_cross_devices_once_per_update():
    parameters = 3 * 2 + 2
    plain_elements, _ = _count_reduced_elements(None)
    accumulated_elements, _ = _count_reduced_elements(4)
    # 8 micro-steps: plain all-reduces every gradient 8 times; the wrapper
    # all-reduces them twice (2 updates) plus one scalar "finite?" flag
    # per update.
    assert plain_elements == 8 * parameters
    assert accumulated_elements == 2 * parameters + 2


def _overflow_on_replica_one_data():
    # Under MirroredStrategy, each global batch of 8 is split in two: the
    # second half goes to replica 1. Only replica 1 of step 2 sees inputs
    # large enough to overflow float16 gradients at the initial loss scale.
    x, y = regression_data(48, features=4)
    x[2 * 8 + 4 : 2 * 8 + 8] = 3.0e3
    return x, y


def _fit_mixed_precision(strategy, accumulation):
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = _overflow_on_replica_one_data()
        with strategy.scope():
            keras.utils.set_random_seed(4)
            model = keras.Sequential(
                [
                    keras.Input((4,)),
                    keras.layers.Dense(16, activation="relu"),
                    keras.layers.Dense(1, dtype="float32"),
                ]
            )
            optimizer = keras.optimizers.SGD(0.01)
            if accumulation:
                optimizer = GradientAccumulationOptimizer(
                    optimizer, accumulation
                )
            model.compile(optimizer=optimizer, loss="mse")
        model.fit(x, y, batch_size=8, shuffle=False, verbose=0)
        return model
    finally:
        keras.mixed_precision.set_global_policy("float32")


@pytest.mark.parametrize("strategy_name", ["mirrored_2", "mirrored_4"])
def test_mixed_precision_overflow_on_one_replica_is_skipped(strategy_name):
    from conftest import make_strategy

    model = _fit_mixed_precision(make_strategy(strategy_name), 2)
    assert isinstance(model.optimizer, keras.optimizers.LossScaleOptimizer)
    wrapper = model.optimizer.inner_optimizer
    assert isinstance(wrapper, GradientAccumulationOptimizer)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())
    # The window containing the overflowing micro-batch was dropped on
    # every replica at once.
    assert int(wrapper.skipped_updates.numpy()) == 1
    assert int(wrapper.iterations.numpy()) == 2


def test_mixed_precision_trains_on_one_device():
    model = _fit_mixed_precision(tf.distribute.get_strategy(), 2)
    assert all(np.all(np.isfinite(w)) for w in model.get_weights())


@pytest.mark.slow
def test_multi_worker_custom_loop_matches_one_device():
    from optimizers.accumulation_process_bodies import reference_weights

    results = run_workers(
        "optimizers.accumulation_process_bodies:multi_worker_custom_loop",
        num_workers=2,
        timeout=240,
    )
    expected = reference_weights(num_replicas=2)
    for result in results:
        assert result["replicas"] == 2
        assert result["iterations"] == 4
        assert result["micro_steps"] == 12
        assert_weights_close(
            [np.asarray(w) for w in result["weights"]],
            [np.asarray(w) for w in expected],
        )


@pytest.mark.slow
def test_mirrored_with_default_cross_device_ops_in_own_process():
    result = run_in_process(
        "optimizers.accumulation_process_bodies:"
        "mirrored_default_cross_device_ops",
        timeout=240,
    )
    assert result["cross_device_ops"] != "ReductionToOneDevice"
    assert result["iterations"] == 4
    assert_weights_close(
        [np.asarray(w) for w in result["weights"]],
        [np.asarray(w) for w in result["reference"]],
    )

"""Limits of Keras 3 itself, one test per row of the compatibility table
(docs/compatibility.md), each marked with the backend it is measured on:
TensorFlow's (tf.distribute strategies) and JAX's (`keras.distribution`).

None of these uses a keras_mgpu component: each asserts that plain Keras
still fails (or is still wrong, or slow) the way it was measured, so that a
Keras release fixing it makes the test fail and we update the table (and,
for the JAX rows that shape our speed figures, the benchmarks page).
"""

from __future__ import annotations

import numpy as np
import pytest
from _processes import run_in_process, run_workers
from _training import mlp, regression_data
from conftest import make_strategy

from keras_mgpu._flavour import keras

pytestmark = [
    pytest.mark.backends("tensorflow", "jax"),
    pytest.mark.keras_limit,
]


def _fit_plain(strategy, optimizer="sgd", model=None, epochs=1, **compile_kw):
    x, y = regression_data(32)
    with strategy.scope():
        model = model() if model else mlp()
        model.compile(optimizer=optimizer, loss="mse", **compile_kw)
    return model, model.fit(
        x, y, batch_size=8, epochs=epochs, shuffle=False, verbose=0
    )


@pytest.mark.backends("tensorflow")
def test_builtin_gradient_accumulation_fails_under_mirrored():
    strategy = make_strategy("mirrored_2")
    with pytest.raises(Exception, match="merge_call"):
        with strategy.scope():
            optimizer = keras.optimizers.SGD(gradient_accumulation_steps=2)
        _fit_plain(strategy, optimizer=optimizer)


@pytest.mark.backends("tensorflow")
def test_builtin_gradient_accumulation_schedules_count_micro_steps():
    schedule = keras.optimizers.schedules.PiecewiseConstantDecay(
        [2], [0.1, 0.01]
    )
    optimizer = keras.optimizers.SGD(schedule, gradient_accumulation_steps=4)
    model, _ = _fit_plain(make_strategy("default"), optimizer=optimizer)
    # 4 micro-steps = 1 update, yet the schedule already moved past step 2.
    assert int(optimizer.iterations.numpy()) == 1
    assert float(optimizer.learning_rate.numpy()) == pytest.approx(0.01)


@pytest.mark.backends("tensorflow")
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


@pytest.mark.backends("tensorflow")
def test_jit_compile_fails_under_mirrored_on_cpu():
    with pytest.raises(Exception, match="resource|device"):
        _fit_plain(make_strategy("mirrored_2"), jit_compile=True)


@pytest.mark.backends("tensorflow")
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


@pytest.mark.backends("tensorflow")
def test_central_storage_reports_a_wrong_loss_with_right_weights():
    _, one = _fit_plain(make_strategy("default"))
    model_cs, central = _fit_plain(make_strategy("central_storage"))
    model_one, _ = _fit_plain(make_strategy("default"))
    for a, b in zip(model_cs.get_weights(), model_one.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert central.history["loss"][0] != pytest.approx(
        one.history["loss"][0], rel=1e-3
    )


@pytest.mark.backends("tensorflow")
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


@pytest.mark.backends("tensorflow")
def test_mixed_precision_overflow_on_one_replica_gives_nan_weights():
    from optimizers.test_gradient_accumulation_distributed import (
        _fit_mixed_precision,
    )

    model = _fit_mixed_precision(make_strategy("mirrored_2"), None)
    assert any(np.any(~np.isfinite(w)) for w in model.get_weights())


@pytest.mark.backends("tensorflow")
def test_remat_scope_fails_in_fit():
    def remat_model():
        with keras.RematScope(mode="full"):
            return mlp()

    with pytest.raises(Exception, match="custom_gradient|keyword"):
        _fit_plain(make_strategy("default"), model=remat_model)


@pytest.mark.backends("tensorflow")
@pytest.mark.slow
def test_fit_fails_under_multi_worker_mirrored():
    results = run_workers("keras_limits_bodies:multi_worker_fit", timeout=180)
    for result in results:
        assert result["error"] is not None
        assert "PerReplica" in result["error"]


@pytest.mark.backends("tensorflow")
@pytest.mark.slow
def test_fit_fails_under_parameter_server():
    result = run_in_process(
        "keras_limits_bodies:parameter_server_fit", timeout=180
    )
    assert result["error"] is not None
    assert "create_per_worker_dataset" in result["error"] or (
        "ParameterServerStrategy" in result["error"]
    )


@pytest.mark.backends("tensorflow")
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


@pytest.mark.backends("tensorflow")
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


# ----------------------------------------------------------------------
# The JAX backend
# ----------------------------------------------------------------------
_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class _CompileMarks(keras.callbacks.Callback):
    """The number of XLA compilations so far at each batch's begin (the
    train step compiles while its batch is dispatched, before the next
    batch begins)."""

    def __init__(self, counter: list) -> None:
        super().__init__()
        self.counter = counter
        self.marks: list[tuple[int, int, int]] = []

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_begin(self, batch, logs=None):
        self.marks.append((self.epoch, batch, len(self.counter)))

    def compiles_inside_steps(self) -> list[tuple[int, int]]:
        """(epoch, batch) of each step during which something compiled
        (from one batch's begin to the next one's, in the same epoch)."""
        found = []
        for (epoch, batch, n), (next_epoch, _, m) in zip(
            self.marks, self.marks[1:]
        ):
            if epoch == next_epoch and m > n:
                found.append((epoch, batch))
        return found


@pytest.fixture
def compile_counter():
    counter: list = []

    def listener(name, seconds, **kwargs):
        if name == _COMPILE_EVENT:
            counter.append(seconds)

    from jax import monitoring

    monitoring.register_event_duration_secs_listener(listener)
    yield counter
    # JAX has no public way to remove one listener; this one only appends
    # to a list nobody reads after the test.


def _fit_three_epochs(counter, distribution) -> list[tuple[int, int]]:
    x = np.ones((64, 8), "float32")
    y = np.ones((64, 1), "float32")
    marks = _CompileMarks(counter)
    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(distribution)
    try:
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(16), keras.layers.Dense(1)]
        )
        model.compile("adam", "mse")
        model.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[marks])
    finally:
        keras.distribution.set_distribution(previous)
    return marks.compiles_inside_steps()


@pytest.mark.backends("jax")
def test_data_parallel_on_one_device_recompiles_the_train_step(
    compile_counter,
):
    """Keras 3.15 on JAX, `DataParallel` over ONE device (the usual setup on
    a one-GPU machine, as in the H200 figures of the benchmarks page): the
    train step compiles at the first step, again at the second (the state
    comes back with a single-device sharding) and again at the first step
    of the next epoch (the state is read back from the variables). Without
    a distribution, and with DataParallel over 4 devices, it compiles once.
    A recompile of a BERT step inside an epoch adds its seconds to that
    epoch's time per step. Fails once Keras compiles the step once."""
    import jax

    plain = _fit_three_epochs(compile_counter, None)
    assert plain == [(0, 0)]
    four = _fit_three_epochs(
        compile_counter,
        keras.distribution.DataParallel(devices=jax.devices()[:4]),
    )
    assert four == [(0, 0)]
    one = _fit_three_epochs(
        compile_counter,
        keras.distribution.DataParallel(devices=jax.devices()[:1]),
    )
    assert one == [(0, 0), (0, 1), (1, 0)]

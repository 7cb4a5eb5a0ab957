"""find_batch_size / configure_batch / plan_batch on Keras's JAX backend:
the answer read from XLA's compiled train step, checked against the same
step compiled here independently (the model's `train_step`, jitted as
Keras's JAX trainer does)."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest

import keras_mgpu
from keras_mgpu.optimizers import GradientAccumulationOptimizer

BUDGET_MB = 8.0
RNG = np.random.default_rng(0)
X = RNG.normal(size=(16, 64)).astype("float32")
Y = RNG.normal(size=(16, 1)).astype("float32")


def mlp(optimizer="adam") -> keras.Model:
    model = keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(256, activation="relu"),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer, "mse")
    return model


def compiled_need_mb(model: keras.Model, batch: int) -> float:
    """What one device needs for `model`'s train step at `batch`: XLA's
    memory analysis, state donated (the plain computation the finder
    must agree with)."""
    state = tuple(
        [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in variables]
        for variables in (
            model.trainable_variables,
            model.non_trainable_variables,
            model.optimizer.variables,
            model.metrics_variables,
        )
    )
    data = (
        jax.ShapeDtypeStruct((batch, 64), "float32"),
        jax.ShapeDtypeStruct((batch, 1), "float32"),
    )
    compiled = (
        jax.jit(model.train_step, donate_argnums=0).lower(state, data).compile()
    )
    m = compiled.memory_analysis()
    need = (
        m.argument_size_in_bytes
        + m.output_size_in_bytes
        - m.alias_size_in_bytes
        + m.temp_size_in_bytes
    )
    return need / 2**20


@pytest.fixture(scope="module")
def found():
    model = mlp()
    weights = [np.array(w) for w in model.weights]
    result = keras_mgpu.find_batch_size(
        model, (X, Y), memory_budget_mb=BUDGET_MB
    )
    return model, weights, result


@pytest.mark.slow
def test_answer_fits_and_the_next_candidate_does_not(found):
    model, weights, result = found
    assert result.measured_by == "compiled" and result.safety_margin == 0
    assert result.limited_by == "memory"
    assert result.budget_mb == BUDGET_MB
    # The user's model was not trained (a copy was).
    for before, after in zip(weights, model.weights, strict=True):
        np.testing.assert_array_equal(before, np.array(after))
    model.train_on_batch(X[:2], Y[:2])  # builds its optimizer state
    answer = result.batch_size
    need = compiled_need_mb(model, answer)
    assert need <= BUDGET_MB
    assert need == pytest.approx(result.measured_peak_mb, rel=1e-6)
    assert compiled_need_mb(model, int(answer * 1.3)) > BUDGET_MB
    # The largest batch that fits lies below the bracket's upper end.
    assert result.upper_bound is not None
    assert compiled_need_mb(model, result.upper_bound) > BUDGET_MB
    assert answer >= 0.7 * result.upper_bound
    # A few compilations (the need is close to affine in the batch).
    assert len(result.measurements) <= 6
    sizes = sorted(result.measurements)
    needs = [mb for _, mb in sizes]
    assert needs == sorted(needs)  # monotone in the batch
    assert result.per_sample_mb > 0
    assert "compiled by XLA" in result.explain()


def largest_fitting_compiled(model, budget_mb: float, lo: int, hi: int):
    """Bisection on XLA's compiled need: the largest batch in [lo, hi)
    within `budget_mb` (`lo` fits, `hi` does not), to ~5%."""
    assert compiled_need_mb(model, lo) <= budget_mb
    assert compiled_need_mb(model, hi) > budget_mb
    while hi - lo > max(lo // 20, 1):
        middle = (lo + hi) // 2
        if compiled_need_mb(model, middle) <= budget_mb:
            lo = middle
        else:
            hi = middle
    return lo


@pytest.mark.slow
def test_near_maximal_with_the_default_and_an_explicit_margin(found):
    # Issue 31 on JAX: the answer against the largest batch whose compiled
    # need fits, found by bisection here; with `safety_margin` against
    # the budget less the margin.
    model, _, result = found
    model.train_on_batch(X[:2], Y[:2])  # builds its optimizer state
    answer = result.batch_size
    # Below 1/0.7 of the answer, where the need is over the budget.
    top = int(answer / 0.7) + 1
    largest = largest_fitting_compiled(model, BUDGET_MB, answer, top)
    assert answer >= 0.7 * largest, (answer, largest)
    margined = keras_mgpu.find_batch_size(
        mlp(), (X, Y), memory_budget_mb=BUDGET_MB, safety_margin=0.25
    )
    assert margined.safety_margin == 0.25
    assert margined.search_budget_mb == pytest.approx(0.75 * BUDGET_MB)
    assert "less a 25% safety margin" in margined.explain()
    within = margined.batch_size
    assert compiled_need_mb(model, within) <= 0.75 * BUDGET_MB
    # Not lower than needed: 1/0.7 of it needs more than the budget left.
    assert compiled_need_mb(model, int(within / 0.7) + 1) > 0.75 * BUDGET_MB


def test_cap_and_multiple_of():
    result = keras_mgpu.find_batch_size(
        mlp("sgd"),
        (X, Y),
        memory_budget_mb=BUDGET_MB,
        max_batch_size=100,
        multiple_of=8,
    )
    assert result.batch_size == 96
    assert result.limited_by == "max_batch_size"


@pytest.mark.slow
def test_configure_batch_under_data_parallel():
    devices = keras.distribution.list_devices("cpu")
    distribution = keras.distribution.DataParallel(devices=devices)
    with distribution.scope():
        model = mlp(keras.optimizers.SGD(0.1))
    setup = keras_mgpu.configure_batch(
        model,
        (X, Y),
        global_batch_size=16384,
        base_batch_size=256,
        memory_budget_mb=BUDGET_MB,
        strategy=distribution,
    )
    assert setup.num_replicas == 4
    search = setup.search
    # Per device: each replica's share of the batch, the weights whole.
    assert BUDGET_MB / 2 < search.measured_peak_mb <= BUDGET_MB
    assert setup.per_replica_batch_size <= search.batch_size < 4096
    assert setup.per_replica_batch_size * 4 * setup.accumulation_steps == 16384
    assert setup.accumulation_steps > 1
    assert isinstance(setup.optimizer, GradientAccumulationOptimizer)
    assert setup.learning_rate == pytest.approx(0.1 * 16384 / 256)


def test_plan_batch_counts_the_distribution_replicas():
    devices = keras.distribution.list_devices("cpu")
    distribution = keras.distribution.DataParallel(devices=devices)
    plan = keras_mgpu.plan_batch(4096, 300, strategy=distribution)
    assert (plan.per_replica_batch_size, plan.accumulation_steps) == (256, 4)
    assert plan.num_replicas == 4
    with pytest.raises(keras_mgpu.batch_size.NoExactSplitError):
        keras_mgpu.plan_batch(4097, 300, strategy=distribution)


def test_errors():
    model = mlp("sgd")
    with pytest.raises(ValueError, match="pass `memory_budget_mb`"):
        keras_mgpu.find_batch_size(model, (X, Y))
    with pytest.raises(ValueError, match="memory_fraction"):
        keras_mgpu.find_batch_size(model, (X, Y), memory_fraction=0.5)
    with pytest.raises(TypeError, match="keras.distribution"):
        keras_mgpu.find_batch_size(
            model, (X, Y), memory_budget_mb=8, strategy="mirrored"
        )
    with pytest.raises(ValueError, match="`device` must be one of"):
        keras_mgpu.find_batch_size(
            model, (X, Y), memory_budget_mb=8, device="gpu:7"
        )
    with pytest.raises(
        ValueError,
        match=r"Argument `safety_margin` must be a number >= 0\.0 and <= "
        r"0\.5 or None\. Received: safety_margin=0\.6",
    ):
        keras_mgpu.find_batch_size(
            model, (X, Y), memory_budget_mb=8, safety_margin=0.6
        )
    with pytest.raises(ValueError, match="`memory_budget_mb`=0.1 is too"):
        keras_mgpu.find_batch_size(model, (X, Y), memory_budget_mb=0.1)

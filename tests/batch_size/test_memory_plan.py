"""`plan_memory` (JAX): a plan that fits a budget plain training does not,
trained to the plain large-batch weights; its activation reading against
XLA's compiled memory analysis; the model left as it was; refusals."""

from __future__ import annotations

import keras
import numpy as np
import pytest

import keras_mgpu
from keras_mgpu.backend import BackendNotSupportedError

pytestmark = pytest.mark.backends("tensorflow", "jax")

WIDTH, DEPTH, SAMPLES = 64, 6, 1024


def _mlp():
    """Wide activations, small weights: activations decide what fits."""
    inputs = keras.Input((16,))
    x = inputs
    for i in range(DEPTH):
        x = keras.layers.Dense(WIDTH, activation="gelu", name=f"dense_{i}")(x)
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(x))


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 16)).astype("float32")
    y = rng.normal(size=(SAMPLES, 1)).astype("float32")
    return x, y


def _compiled():
    keras_mgpu.testing.set_random_seed(0)
    model = _mlp()
    model.compile(keras.optimizers.SGD(0.05), "mse")
    return model


def _plain_candidate(plan):
    return next(
        c
        for c in plan.candidates
        if c.accumulation_steps == 1
        and c.policy == "none"
        and not c.shard_state
    )


@pytest.mark.backends("jax")
def test_plan_fits_where_plain_does_not_and_trains_like_plain():
    x, y = _data()
    distribution = keras.distribution.DataParallel()
    with distribution.scope():
        model = _compiled()
        plain = _plain_candidate(
            keras_mgpu.plan_memory(model, (x, y), memory_budget_mb=1e6)
        )
        budget = 0.5 * plain.memory_mb
        plan = keras_mgpu.plan_memory(model, (x, y), memory_budget_mb=budget)
        assert not _plain_candidate(plan).fits
        assert plan.fits and plan.chosen.memory_mb <= budget
        assert plan.chosen.changes() >= 1
        # Every combination read: 4 policies (3 with offload too) x 5 K x
        # state sharded or not (4 data-parallel devices).
        assert len(plan.candidates) == 7 * 5 * 2
        assert "MemoryPlan: " in str(plan) and "fits" in str(plan)
        plan.apply(model)
        model.fit(
            x, y, batch_size=plan.batch_size, epochs=1, shuffle=False, verbose=0
        )
    # The plain computation: one device, the whole batch per update.
    reference = _compiled()
    reference.fit(x, y, batch_size=SAMPLES, epochs=1, shuffle=False, verbose=0)
    for want, got in zip(
        reference.get_weights(), model.get_weights(), strict=True
    ):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.backends("jax")
def test_activation_reading_tracks_xla_and_the_model_is_left_as_it_was():
    import jax

    x, y = _data()
    model = _compiled()
    plan = keras_mgpu.plan_memory(
        model,
        (x, y),
        memory_budget_mb=1e6,
        policies=("none", "per_layer"),
        accumulation_steps=(1, 2, 4),
    )
    assert keras_mgpu.recomputed_layers(model) == []
    assert type(model.optimizer) is keras.optimizers.SGD
    plain = _plain_candidate(plan)
    # Without recompute, XLA's compiled memory analysis of the gradient
    # program sees the activations too (on CPU it does not see recompute).

    def step(trainable, non_trainable, inputs, targets):
        y_pred, _ = model.stateless_call(
            trainable, non_trainable, inputs, training=True
        )
        return jax.numpy.mean(jax.numpy.square(y_pred - targets))

    values = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
    )
    compiled = jax.jit(jax.grad(step)).lower(*values, x, y).compile()
    temp_mb = compiled.memory_analysis().temp_size_in_bytes / 2**20
    assert abs(plain.parts_mb["activations"] - temp_mb) < 0.1 * temp_mb
    # K=4 reads a quarter of the batch's activations (traced), K=2 half
    # (on the line through the two traced sizes); recompute keeps fewer,
    # costs more FLOPs.
    for k in (2, 4):
        part = next(
            c
            for c in plan.candidates
            if c.accumulation_steps == k and c.policy == "none"
        )
        assert part.parts_mb["activations"] == pytest.approx(
            plain.parts_mb["activations"] / k, rel=0.05
        )
    recomputed = next(
        c
        for c in plan.candidates
        if c.accumulation_steps == 1 and c.policy == "per_layer" and c.offload
    )
    assert recomputed.parts_mb["activations"] < plain.parts_mb["activations"]
    assert recomputed.flops > plain.flops
    assert recomputed.host_mb > 0 and plain.host_mb == 0


@pytest.mark.backends("jax")
def test_bad_arguments():
    x, y = _data()
    plan = keras_mgpu.plan_memory
    model = _mlp()
    with pytest.raises(ValueError, match="must be compiled"):
        plan(model, (x, y), memory_budget_mb=10)
    model = _compiled()
    cases = [
        (lambda: plan(model, (x, y), memory_budget_mb=0), "memory_budget_mb"),
        (lambda: plan(model, [x, y], memory_budget_mb=1), "tuple `\\(x, y\\)`"),
        (
            lambda: plan(model, (x, y), 1, policies=("tiny",)),
            "policies=\\('tiny',\\)",
        ),
        (
            lambda: plan(model, (x, y), 1, accumulation_steps=(3,)),
            "accumulation_steps=\\(3,\\)",
        ),
        (
            lambda: plan(model, (x[:8], y[:8]), 1, global_batch_size=64),
            "has 8 samples",
        ),
        (lambda: plan("m", (x, y), 1), "keras.Model"),
    ]
    for call, match in cases:
        with pytest.raises((ValueError, TypeError), match=match):
            call()
    keras_mgpu.apply_recompute(model)
    with pytest.raises(ValueError, match="strip_recompute"):
        plan(model, (x, y), memory_budget_mb=1)
    keras_mgpu.strip_recompute(model)
    model.compile(
        keras_mgpu.GradientAccumulationOptimizer(keras.optimizers.SGD(), 2),
        "mse",
    )
    with pytest.raises(ValueError, match="plain optimizer"):
        plan(model, (x, y), memory_budget_mb=1)


@pytest.mark.backends("tensorflow")
def test_tensorflow_refuses_naming_what_to_use():
    model = _compiled()
    with pytest.raises(BackendNotSupportedError, match="configure_batch"):
        keras_mgpu.plan_memory(model, _data(), memory_budget_mb=100)

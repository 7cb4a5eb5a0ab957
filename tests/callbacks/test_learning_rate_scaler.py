"""LearningRateScaler on both backends: the factor from the strategy or
`keras.distribution` in force and the accumulation in use, applied inside
the compiled step, composing with ReduceLROnPlateau and warmup."""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import pytest
from callbacks import lr_jax_helpers
from callbacks._lr_argument_cases import SCALER_BAD_INPUT
from callbacks._lr_recording import (
    JAX,
    RecordingSGD,
    data,
    expected_warmup,
    tiny_model,
)

from keras_mgpu.callbacks import LearningRateScaler, LearningRateWarmup

pytestmark = pytest.mark.backends("tensorflow", "jax")

PER_REPLICA = 2

TF_ONLY = pytest.mark.backends("tensorflow")
JAX_ONLY = pytest.mark.backends("jax")


def _tf_case(name):
    rule = "sqrt" if name in ("one_device", "mirrored_4") else "linear"
    return pytest.param(
        name, 2, "keras_mgpu", rule, "per_replica", marks=TF_ONLY, id=name
    )


# (strategy or distribution, accumulation, accumulation wrapper, rule,
# per-replica or global batch given). TensorFlow: every entry of its
# strategy matrix under keras_mgpu's GradientAccumulationOptimizer; JAX:
# no distribution, DataParallel x4 and ModelParallel 2x2, with Keras's own
# accumulation, bare or inside a wrapper shaped like keras_mgpu's.
SCALE_CASES = [
    *(
        _tf_case(name)
        for name in (
            "default",
            "one_device",
            "mirrored_2",
            "mirrored_4",
            "central_storage",
        )
    ),
    pytest.param(
        "none", 2, "stand_in", "linear", "per_replica", marks=JAX_ONLY
    ),
    pytest.param(
        "data_parallel", 2, None, "sqrt", "per_replica", marks=JAX_ONLY
    ),
    pytest.param("data_parallel", 1, None, "linear", "global", marks=JAX_ONLY),
    pytest.param(
        "model_parallel", 2, "stand_in", "linear", "per_replica", marks=JAX_ONLY
    ),
]


def _distributed(name):
    """(scope to build in, scope to fit in, data-parallel replicas) of a
    case: on JAX `fit` runs inside the distribution too (Keras reads the
    one in force to split the batch), on TensorFlow the model carries its
    strategy."""
    if JAX:
        distribution = lr_jax_helpers.make_distribution(name)

        def scope():
            return lr_jax_helpers.scope(distribution)

        return scope, scope, lr_jax_helpers.replicas_of(name)
    from conftest import make_strategy

    strategy = make_strategy(name)
    return strategy.scope, contextlib.nullcontext, strategy.num_replicas_in_sync


def _optimizer(accumulation, wrapper):
    """The recording optimizer and what `compile` gets: keras_mgpu's
    accumulation wrapper (TensorFlow), or Keras's accumulation, bare or in
    the stand-in wrapper (JAX)."""
    if wrapper == "keras_mgpu":
        import keras_mgpu

        inner = RecordingSGD(0.1)
        return inner, keras_mgpu.GradientAccumulationOptimizer(
            inner, accumulation
        )
    inner = RecordingSGD(
        0.1,
        gradient_accumulation_steps=accumulation if accumulation > 1 else None,
    )
    if wrapper == "stand_in":
        return inner, lr_jax_helpers.StandInAccumulation(inner)
    return inner, inner


@pytest.mark.parametrize(
    "name, accumulation, wrapper, rule, given", SCALE_CASES
)
def test_factor_from_distribution_and_accumulation(
    name, accumulation, wrapper, rule, given
):
    build_scope, fit_scope, replicas = _distributed(name)
    with build_scope():
        model = tiny_model()
        inner, optimizer = _optimizer(accumulation, wrapper)
        model.compile(optimizer=optimizer, loss="mse")
    batch = PER_REPLICA * replicas  # the global batch of one step
    scaler = LearningRateScaler(
        base_batch_size=2,
        scaling_rule=rule,
        **(
            {"per_replica_batch_size": PER_REPLICA}
            if given == "per_replica"
            else {"batch_size": batch}
        ),
    )
    x, y = data(4 * accumulation, batch)
    with fit_scope():
        history = model.fit(
            x, y, batch_size=batch, epochs=2, verbose=0, callbacks=[scaler]
        )
    ratio = replicas * accumulation
    factor = ratio if rule == "linear" else np.sqrt(ratio)
    assert scaler.global_batch_size == PER_REPLICA * ratio
    assert scaler.factor == pytest.approx(factor)
    recorded = inner.recorded()
    assert len(recorded) == 8  # updates
    np.testing.assert_allclose(recorded, 0.1 * factor, rtol=1e-6)
    assert history.history["learning_rate"] == pytest.approx([0.1 * factor] * 2)
    # The variable kept the base rate: config and checkpoints are clean.
    assert inner.get_config()["learning_rate"] == pytest.approx(0.1)


def test_composes_with_reduce_on_plateau_and_warmup(caplog):
    """ReduceLROnPlateau reads the scaled rate and writes a scaled rate;
    warmup ramps to it."""
    model = tiny_model()
    inner = RecordingSGD(0.1)
    model.compile(optimizer=inner, loss="mse", steps_per_execution=2)
    x, y = data(4, 4)
    plateau = keras.callbacks.ReduceLROnPlateau(
        monitor="loss", factor=0.5, patience=0, min_delta=1e9, min_lr=0.0
    )
    with caplog.at_level("INFO", logger="keras_mgpu"):
        history = model.fit(
            x,
            y,
            batch_size=4,
            epochs=3,
            verbose=0,
            callbacks=[
                LearningRateScaler(base_batch_size=2, batch_size=4),
                LearningRateWarmup(warmup_steps=2),
                plateau,
            ],
        )
    assert caplog.text.count("learning rate x 2 (linear rule)") == 1
    assert "(1 replicas, 1 accumulation steps)" in caplog.text
    # Scaled to 0.2; the plateau halves it from the end of epoch 1 on (the
    # first epoch always counts as an improvement).
    targets = [0.2, 0.2, 0.1]
    expected = [
        expected_warmup(n, 2, 0.0, targets[n // 4], "linear") for n in range(12)
    ]
    np.testing.assert_allclose(inner.recorded(), expected, rtol=1e-5)
    assert history.history["learning_rate"] == pytest.approx(
        [0.2, 0.2, 0.1]  # Keras logs the rate before its reduction
    )
    # Base variable: the plateau's reductions divided by the factor.
    assert float(inner._learning_rate.numpy()) == pytest.approx(0.025)


def test_a_new_factor_is_traced_afresh():
    """The factor is a constant of the compiled step: a second fit with
    another factor must not reuse the first fit's compiled step."""
    model = tiny_model()
    inner = RecordingSGD(0.1)
    model.compile(optimizer=inner, loss="mse")
    x, y = data(2, 4)
    for base in (2, 1):  # same shapes: JAX's cache would serve either
        model.fit(
            x,
            y,
            batch_size=4,
            verbose=0,
            callbacks=[LearningRateScaler(base_batch_size=base, batch_size=4)],
        )
    np.testing.assert_allclose(
        inner.recorded(), [0.2, 0.2, 0.4, 0.4], rtol=1e-6
    )


def test_needs_batch_size():
    model = tiny_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data(2, 4)
    with pytest.raises(ValueError, match=r"LearningRateScaler needs the"):
        model.fit(
            x,
            y,
            batch_size=4,
            verbose=0,
            callbacks=[LearningRateScaler(base_batch_size=4)],
        )


@pytest.mark.parametrize("kwargs, error, match", SCALER_BAD_INPUT)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        LearningRateScaler(**kwargs)


def test_renamed_rule_and_keras_verbose_default():
    assert LearningRateScaler(base_batch_size=8).verbose == 0  # as Keras
    with pytest.warns(FutureWarning, match="use `scaling_rule` instead"):
        scaler = LearningRateScaler(base_batch_size=8, rule="sqrt")
    assert scaler.scaling_rule == "sqrt"


@pytest.mark.slow
@pytest.mark.backends("tensorflow")
def test_two_workers_custom_loop():
    """MultiWorkerMirrored x2 (custom loop: Keras 3.15 fit fails there)."""
    from _processes import run_workers

    results = run_workers("callbacks.lr_mw_bodies:train_body", 2, timeout=150)
    for result in results:
        assert result["replicas"] == 2
        assert result["factor"] == pytest.approx(2.0)
        expected = [expected_warmup(n, 4, 0.0, 0.2, "cosine") for n in range(6)]
        np.testing.assert_allclose(result["recorded"], expected, rtol=1e-5)
        assert result["logs_lr"] == pytest.approx(0.2)
        assert result["config_lr"] == pytest.approx(0.1)
    assert results[0]["recorded"] == results[1]["recorded"]


@pytest.mark.keras_limit
@pytest.mark.backends("jax")
def test_keras_force_made_train_function_can_reuse_a_stale_trace():
    """Keras limit (3.15, JAX 0.10): `make_train_function(force=True)`
    jits `model.train_step` again, and JAX keys its trace cache on the
    function by equality: while an earlier train function is alive, the new
    one gets its trace back, with the Python-side learning rate it was
    traced with. keras_mgpu's callbacks trace with a fresh function
    (`keras_mgpu.backend.jax.train_function`). Fails once either retraces.
    """

    class Scaled:
        def __init__(self, variable, factor):
            self.variable, self.factor = variable, factor

        def __call__(self):
            return self.variable.value * self.factor

    model = tiny_model()
    optimizer = RecordingSGD(0.1)
    model.compile(optimizer=optimizer, loss="mse")
    x, y = data(1, 4)
    model.fit(x, y, batch_size=4, verbose=0)  # builds the optimizer
    variable = optimizer._learning_rate
    kept = []
    for factor in (2.0, 3.0):
        optimizer._learning_rate = Scaled(variable, factor)
        model.make_train_function(force=True)
        kept.append(model.train_function)  # alive, as the callbacks keep it
        model.fit(x, y, batch_size=4, verbose=0)
    # The second fit ran with factor 2, not 3.
    np.testing.assert_allclose(optimizer.recorded(), [0.1, 0.2, 0.2], rtol=1e-6)

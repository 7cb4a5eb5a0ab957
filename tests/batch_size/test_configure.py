"""configure_batch: the planned micro-batch, accumulation and scaled
learning rate train exactly like the plain target global batch.

Memory is read from the fake allocator (see `_fakes.py`), whose line is
`10 + 0.5 * batch` MB; the training steps are real.
"""

from __future__ import annotations

import pytest
from _training import assert_weights_close, mlp, regression_data
from batch_size import _fakes
from conftest import make_strategy
from optimizers.test_gradient_accumulation import OPTIMIZERS

from keras_mgpu import GradientAccumulationOptimizer, configure_batch
from keras_mgpu._flavour import keras, tf
from keras_mgpu.batch_size import NoExactSplitError
from keras_mgpu.callbacks import LearningRateScaler

fake_allocator = _fakes.fake_allocator  # the fixture
GLOBAL_BATCH = 48
UPDATES = 4
X, Y = regression_data(GLOBAL_BATCH * UPDATES)
# 10 + 0.5 b <= 14.2 MB (the budget less find_batch_size's safety margin):
# micro-batches of at most 8 fit.
BUDGET_FOR_8 = _fakes.budget_for(8)


def _compiled(strategy, optimizer_name):
    with strategy.scope():
        model = mlp()
        model.compile(optimizer=OPTIMIZERS[optimizer_name](), loss="mse")
    return model


@pytest.mark.parametrize("optimizer_name", ["momentum", "adamw"])
def test_planned_training_equals_the_plain_global_batch(
    optimizer_name, fake_allocator
):
    strategy = make_strategy("mirrored_2")
    model = _compiled(strategy, optimizer_name)
    setup = configure_batch(
        model,
        (X, Y),
        GLOBAL_BATCH,
        base_batch_size=16,
        memory_budget_mb=BUDGET_FOR_8,
        verbose=0,
    )
    # 48 = 8 per replica x 2 replicas x 3 accumulation steps.
    assert setup.search.batch_size == 8
    assert (setup.per_replica_batch_size, setup.accumulation_steps) == (8, 3)
    assert setup.step_batch_size == 16
    assert isinstance(setup.optimizer, GradientAccumulationOptimizer)
    assert setup.optimizer.accumulation_steps == 3
    # The probe counted the accumulators: its copy had the wrapper too.
    assert all(
        isinstance(o, GradientAccumulationOptimizer)
        for o in fake_allocator.probe_optimizers
    )
    base = OPTIMIZERS[optimizer_name]().learning_rate
    assert setup.learning_rate == pytest.approx(float(base) * 48 / 16)
    assert isinstance(setup.learning_rate_scaler, LearningRateScaler)
    assert setup.callbacks == [setup.learning_rate_scaler]

    with strategy.scope():
        model.compile(optimizer=setup.optimizer, loss="mse")
    model.fit(
        X,
        Y,
        batch_size=setup.step_batch_size,
        shuffle=False,
        verbose=0,
        callbacks=setup.callbacks,
    )
    assert int(setup.optimizer.iterations.numpy()) == UPDATES

    # Reference: the plain optimizer on one device, one batch of 48 per
    # update, at the scaled learning rate.
    reference = mlp()
    optimizer = OPTIMIZERS[optimizer_name]()
    optimizer.learning_rate = setup.learning_rate
    reference.compile(optimizer=optimizer, loss="mse")
    reference.fit(X, Y, batch_size=GLOBAL_BATCH, shuffle=False, verbose=0)
    assert_weights_close(model.get_weights(), reference.get_weights())


def test_no_accumulation_when_the_share_fits(fake_allocator, capsys):
    strategy = make_strategy("mirrored_2")
    model = _compiled(strategy, "adamw")
    setup = configure_batch(
        model, (X, Y), 16, memory_budget_mb=100.0, verbose=1
    )
    # The search never looks past the share of 8 per replica.
    assert max(fake_allocator.steps) == 8
    assert setup.search.limited_by == "max_batch_size"
    assert (setup.per_replica_batch_size, setup.accumulation_steps) == (8, 1)
    assert type(setup.optimizer) is keras.optimizers.AdamW
    assert setup.optimizer is not model.optimizer  # a fresh copy
    assert setup.optimizer.get_config() == model.optimizer.get_config()
    assert setup.learning_rate == setup.base_learning_rate
    assert setup.learning_rate_scaler is None and setup.callbacks == []
    printed = capsys.readouterr().out
    assert printed.strip() == setup.explanation
    for text in (
        "the largest batch is 8: predicted peak 14.0 MB, measured 14.0 MB, "
        "and it is the cap (max_batch_size).",
        "The target global batch 16 fits without accumulation: 8 per "
        "replica x 2 replica(s), batches of 16 per step, plain AdamW.",
        "The learning rate stays 0.01 (pass base_batch_size to scale it",
    ):
        assert text in printed


def test_explanation_of_accumulation_and_scaling(fake_allocator):
    model = _compiled(tf.distribute.get_strategy(), "momentum")
    setup = configure_batch(
        model,
        (X, Y),
        60,
        base_batch_size=15,
        scaling_rule="sqrt",
        memory_budget_mb=BUDGET_FOR_8,
        verbose=0,
    )
    # 60 on one replica with micro-batches of at most 8: 6 x 10.
    assert (setup.per_replica_batch_size, setup.accumulation_steps) == (6, 10)
    assert setup.learning_rate == pytest.approx(0.05 * 2.0)
    for text in (
        "The target global batch 60 = 6 per replica x 1 replica(s) x 10 "
        "accumulation steps: feed batches of 6 per step and train with "
        "GradientAccumulationOptimizer(SGD, accumulation_steps=10) "
        "(micro-batches of 75% of the 8 that fit: the largest that split "
        "the global batch exactly).",
        "LearningRateScaler(base_batch_size=15) scales the learning rate "
        "0.05 by sqrt(60/15) (sqrt rule) to 0.1.",
    ):
        assert text in setup.explanation


def test_an_accumulating_optimizer_keeps_its_momentum_correction(
    fake_allocator,
):
    with tf.distribute.get_strategy().scope():
        model = mlp()
        inner = keras.optimizers.SGD(0.1, momentum=0.9)
        model.compile(
            optimizer=GradientAccumulationOptimizer(
                inner, 5, momentum_correction=True
            ),
            loss="mse",
        )
    setup = configure_batch(
        model, (X, Y), 16, memory_budget_mb=100.0, verbose=0
    )
    assert setup.accumulation_steps == 1
    assert isinstance(setup.optimizer, GradientAccumulationOptimizer)
    assert setup.optimizer.momentum_correction
    assert setup.optimizer.accumulation_steps == 1
    assert type(setup.optimizer.inner_optimizer) is keras.optimizers.SGD


def test_global_batch_not_a_multiple_of_the_replicas(fake_allocator):
    model = _compiled(make_strategy("mirrored_2"), "momentum")
    with pytest.raises(
        NoExactSplitError,
        match=r"`global_batch_size`=47 is not a multiple of the 2 replicas"
        r".*Nearest that split: 46 = 23 per replica",
    ):
        configure_batch(model, (X, Y), 47, memory_budget_mb=100.0)
    assert fake_allocator.steps == []  # refused before probing


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"global_batch_size": 0}, ValueError, "global_batch_size=0"),
        ({"base_batch_size": 0}, ValueError, "base_batch_size=0"),
        ({"scaling_rule": "cube"}, ValueError, "`scaling_rule` must be one"),
        ({"max_batch_size": -1}, ValueError, "max_batch_size=-1"),
        ({"min_fill": 2}, ValueError, "`min_fill` must be a number"),
        ({"verbose": -1}, ValueError, "verbose=-1"),
        (
            {"safety_margin": 0.75},
            ValueError,
            r"Argument `safety_margin` must be a number >= 0\.0 and <= 0\.5 "
            r"or None\. Received: safety_margin=0\.75",
        ),
    ],
)
def test_bad_arguments(kwargs, error, message, fake_allocator):
    model = _compiled(tf.distribute.get_strategy(), "momentum")
    arguments = {"global_batch_size": 48, "memory_budget_mb": 100.0, **kwargs}
    with pytest.raises(error, match=message):
        configure_batch(model, (X, Y), **arguments)
    assert fake_allocator.steps == []  # refused before probing

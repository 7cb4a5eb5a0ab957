"""BatchNormMicroBatchWarning (Keras 3): once per model when a model with
trainable BatchNormalization is trained with gradient accumulation
(accumulation_steps > 1) or pipelined (micro_batches > 1) with no choice
made; silent once a remedy is chosen, for K = 1 / M = 1, and without BN."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from keras_mgpu import _flavour
from keras_mgpu.normalization import (
    BatchNormMicroBatchWarning,
    accept_micro_batch_statistics,
    convert_batchnorm_to_groupnorm,
    freeze_batchnorm,
)
from keras_mgpu.normalization._find import batchnorm_layers, mark_choice
from keras_mgpu.optimizers import GradientAccumulationOptimizer
from keras_mgpu.placement import apply_placement

keras = _flavour.keras
tf = _flavour.tf

X = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
Y = np.random.default_rng(1).normal(size=(16, 1)).astype("float32")


def _model(batchnorm: bool = True) -> keras.Model:
    layers = [keras.Input((4,)), keras.layers.Dense(8, name="dense")]
    if batchnorm:
        layers.append(keras.layers.BatchNormalization(name="bn"))
    layers.append(keras.layers.Dense(1, name="head"))
    return keras.Sequential(layers, name="bn_net")


def _fit_and_count(model, steps: int, strategy=None, compiles: int = 2):
    """Compile with accumulation and fit, `compiles` times (a new
    optimizer each time); the BN warnings raised."""
    strategy = strategy or tf.distribute.get_strategy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(compiles):
            with strategy.scope():
                model.compile(
                    GradientAccumulationOptimizer(
                        keras.optimizers.SGD(0.01), accumulation_steps=steps
                    ),
                    "mse",
                )
            model.fit(X, Y, batch_size=4, epochs=2, verbose=0)
    found = [
        w for w in caught if issubclass(w.category, BatchNormMicroBatchWarning)
    ]
    # It names the user's line (the `fit` call), not Keras's.
    assert all(w.filename == __file__ for w in found)
    return [str(w.message) for w in found]


def test_accumulation_warns_once_naming_layers_steps_and_choices():
    found = _fit_and_count(_model(), steps=2)
    assert len(found) == 1
    message = found[0]
    for part in (
        "'bn_net' has 1 trainable BatchNormalization layer ('bn')",
        "accumulation_steps=2",
        "use_window_statistics(model, window=...)",
        "freeze_batchnorm(model)",
        "convert_batchnorm_to_groupnorm(model)",
        "accept_micro_batch_statistics(model)",
    ):
        assert part in message
    assert issubclass(BatchNormMicroBatchWarning, UserWarning)


def test_loading_a_saved_model_is_silent_until_it_trains(tmp_path):
    model = _model()
    accept_micro_batch_statistics(model)  # the mark is not saved
    _fit_and_count(model, steps=2, compiles=1)
    path = str(tmp_path / "accumulated.keras")
    model.save(path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchNormMicroBatchWarning)
        loaded = keras.models.load_model(path)  # builds the optimizer
        loaded.predict(X, verbose=0)
    with pytest.warns(BatchNormMicroBatchWarning):
        loaded.fit(X, Y, batch_size=4, verbose=0)


def test_warns_once_under_mirrored_replicas(mirrored_strategy):
    strategy = mirrored_strategy(2)
    with strategy.scope():
        model = _model()
    assert len(_fit_and_count(model, steps=2, strategy=strategy)) == 1


def _window(model):
    # use_window_statistics lives on another branch; its mark is enough.
    for layer in batchnorm_layers(model):
        mark_choice(layer, "window")
    return model


def _groupnorm(model):
    return convert_batchnorm_to_groupnorm(model, groups=1)


@pytest.mark.parametrize(
    "remedy",
    [freeze_batchnorm, accept_micro_batch_statistics, _groupnorm, _window],
    ids=["frozen", "accepted", "groupnorm", "window"],
)
def test_silent_once_a_remedy_is_chosen(remedy):
    model = remedy(_model())
    assert _fit_and_count(model, steps=2, compiles=1) == []


def test_silent_for_one_step_and_without_batchnorm():
    assert _fit_and_count(_model(), steps=1, compiles=1) == []
    assert _fit_and_count(_model(batchnorm=False), steps=3, compiles=1) == []


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "function"])
def test_custom_loop_warns_once_at_the_users_line(graph):
    # No model method on the stack: the model is found by the name the
    # loop holds it under (here a closure's variable), also when AutoGraph
    # converts the step; the warning names this file, not a generated one.
    model = _model()
    optimizer = GradientAccumulationOptimizer(
        keras.optimizers.SGD(0.01), accumulation_steps=2
    )

    def step():
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(X, training=True) - Y) ** 2)
        variables = model.trainable_variables
        optimizer.apply(tape.gradient(loss, variables), variables)

    if graph:
        step = tf.function(step)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            step()
    found = [
        w for w in caught if issubclass(w.category, BatchNormMicroBatchWarning)
    ]
    assert len(found) == 1
    assert "'bn_net' has 1 trainable" in str(found[0].message)
    assert found[0].filename == __file__
    assert optimizer.__dict__["_keras_mgpu_batchnorm_looked"] is True


def test_custom_loop_with_no_model_in_reach_is_silent():
    # Only the model's bound call and its variables are held by name:
    # nothing to name, so no warning and no error, and the look-up stops
    # after a few steps.
    forward = _model().__call__
    variables = list(forward.__self__.trainable_variables)
    optimizer = GradientAccumulationOptimizer(
        keras.optimizers.SGD(0.01), accumulation_steps=2
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchNormMicroBatchWarning)
        for _ in range(4):
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean((forward(X, training=True) - Y) ** 2)
            optimizer.apply(tape.gradient(loss, variables), variables)
    assert optimizer.__dict__["_keras_mgpu_batchnorm_looked"] is True


def test_pipelined_placement_warns_once_and_carries_choices():
    model = _model()
    with pytest.warns(BatchNormMicroBatchWarning, match="micro_batches=2") as w:
        placed = apply_placement(model, ["/cpu:0", "/cpu:1"], micro_batches=2)
    assert w[0].filename == __file__
    # The placed copy counts as warned about (no second warning in fit).
    assert _fit_and_count(placed, steps=2, compiles=1) == []
    with warnings.catch_warnings():
        warnings.simplefilter("error", BatchNormMicroBatchWarning)
        apply_placement(_model(), ["/cpu:0", "/cpu:1"], micro_batches=1)
        chosen = accept_micro_batch_statistics(_model())
        placed = apply_placement(chosen, ["/cpu:0", "/cpu:1"], micro_batches=2)
    assert {
        layer.__dict__.get("_keras_mgpu_batchnorm_choice")
        for layer in batchnorm_layers(placed)
    } == {"accepted"}

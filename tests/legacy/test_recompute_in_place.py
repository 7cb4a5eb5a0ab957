"""tf_keras: `apply_recompute(..., in_place=True)` switches chosen layers
anywhere in the tree to recompute, per layer; blocks with random layers,
`policy="sqrt"` and `group_by` are refused there (Keras 3 only).

Reference: the same model built from the same seed without recompute.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
from _training import assert_weights_close, regression_data
from conftest import make_strategy

from keras_mgpu._flavour import keras, tf
from keras_mgpu.layers import (
    RecomputeGrad,
    apply_recompute,
    recomputed_layers,
    strip_recompute,
)
from keras_mgpu.optimizers import GradientAccumulationOptimizer

X, Y = regression_data(48)


class Counting(keras.layers.Layer):
    """Identity that counts its executions (traces, under tf.function)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def call(self, inputs):
        self.calls += 1
        return inputs


def nested_model(seed: int = 3) -> keras.Model:
    """A user model around a functional sub-model holding `block`."""
    keras.utils.set_random_seed(seed)
    block = keras.Sequential(
        [
            keras.layers.Dense(8, activation="tanh"),
            Counting(),
            keras.layers.BatchNormalization(),
            keras.layers.Dense(6),
        ],
        name="block",
    )
    sub_inputs = keras.Input((6,))
    sub = keras.Model(sub_inputs, block(sub_inputs), name="sub")
    inputs = keras.Input((6,))
    return keras.Model(inputs, keras.layers.Dense(1, name="head")(sub(inputs)))


def step(model, compiled: bool) -> list:
    def run(x):
        with tf.GradientTape() as tape:
            outputs = model(x, training=True)
            loss = tf.reduce_sum(tf.square(outputs))
        return outputs, tape.gradient(loss, model.trainable_variables)

    if compiled:
        run = tf.function(run)
    outputs, grads = run(tf.constant(X[:16]))
    return [
        outputs.numpy(),
        *[g.numpy() for g in grads],
        *[v.numpy() for v in model.non_trainable_variables],
    ]


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "graph"])
def test_nested_block_gradients_identical(compiled):
    plain, model = nested_model(), nested_model()
    assert apply_recompute(model, "block", in_place=True) is model
    assert [layer.name for layer in recomputed_layers(model)] == ["block"]
    counter = model.get_layer("sub").get_layer("block").layers[1]
    counter.calls = 0
    expected, actual = step(plain, compiled), step(model, compiled)
    assert counter.calls == 2  # forward + recomputation
    for a, e in zip(actual, expected, strict=True):
        np.testing.assert_array_equal(a, e)
    strip_recompute(model)
    assert recomputed_layers(model) == []


def test_fit_run_eagerly_trains_like_plain():
    """The eager forward runs with the outer tape paused; gradients and
    BatchNormalization statistics stay those of the plain model."""
    weights = []
    for switch in (False, True):
        model = nested_model()
        if switch:
            apply_recompute(model, "block", in_place=True)
        model.compile(keras.optimizers.SGD(0.05), loss="mse", run_eagerly=True)
        model.fit(X, Y, batch_size=8, epochs=2, shuffle=False, verbose=0)
        weights.append(model.get_weights())
    assert_weights_close(weights[1], weights[0])


@pytest.mark.slow
def test_peak_memory_eager_tf_function_and_fit_run_eagerly():
    """The allocator peak of a step shrinks in an eager custom loop, under
    tf.function and in fit(run_eagerly=True) (oneDNN on, a process of its
    own; see tests/layers/test_recompute_memory.py)."""
    from _processes import run_in_process
    from layers.memory_bodies import assert_recompute_saves_memory

    peaks = run_in_process(
        "layers.memory_bodies:step_peaks",
        timeout=240,
        env={"TF_ENABLE_ONEDNN_OPTS": "1", "TF_USE_LEGACY_KERAS": "1"},
    )
    assert set(peaks) == {"eager", "tf_function", "fit_run_eagerly"}
    assert_recompute_saves_memory(peaks)


@pytest.mark.slow
def test_tf_function_saves_memory_in_any_executor_order():
    """TensorFlow's executor may run the chain of input gradients ahead of
    the weight gradients (one inter-op thread does; a loaded machine did):
    each block's recomputation then stayed alive until the end, 25.5 MiB
    against plain's 22.5 in the default order (the ratio above 1 seen
    under load). The block's input gradients now wait for its weight
    gradients: 8.75 MiB in either order."""
    from _processes import run_in_process

    peaks = run_in_process(
        "legacy.recompute_order_bodies:one_thread_peaks",
        timeout=240,
        env={"TF_ENABLE_ONEDNN_OPTS": "1", "TF_USE_LEGACY_KERAS": "1"},
    )
    assert peaks["plain"] > 10, peaks  # statistics are live
    # Measured, one inter-op thread: 0.23 (0.63 before the order was
    # forced); 0.4 in the default order.
    assert peaks["recompute"] / peaks["plain"] <= 0.5, peaks


@pytest.mark.slow
def test_per_block_recompute_keeps_only_boundaries_and_one_block():
    """The recomputed deep MLP's peak is at most the activations per-block
    recompute keeps and one layer's backward buffers (see
    tests/layers/test_recompute_memory.py)."""
    from _processes import run_in_process
    from layers.memory_bodies import assert_recompute_keeps_only_its_floor

    peaks = run_in_process(
        "layers.memory_bodies:deep_mlp_peaks",
        timeout=240,
        env={"TF_ENABLE_ONEDNN_OPTS": "1", "TF_USE_LEGACY_KERAS": "1"},
    )
    assert_recompute_keeps_only_its_floor(peaks)


@pytest.mark.parametrize("strategy_name", ["default", "mirrored_2"])
def test_stateful_updates_run_once_per_step(strategy_name):
    from _recompute_state import assert_updates_run_once

    assert_updates_run_once(make_strategy(strategy_name), in_place=True)


def test_keras_file_holds_the_plain_model(tmp_path):
    model = nested_model()
    apply_recompute(model, "block", in_place=True)
    path = os.path.join(tmp_path, "model.keras")
    model.save(path)
    loaded = keras.models.load_model(
        path, custom_objects={"Counting": Counting}
    )
    assert recomputed_layers(loaded) == []
    np.testing.assert_allclose(
        loaded.predict(X, verbose=0), model.predict(X, verbose=0), atol=1e-6
    )


def test_refusals():
    inputs = keras.Input((6,))
    noisy = keras.Sequential(
        [keras.layers.Dense(4), keras.layers.Dropout(0.5)], name="noisy"
    )
    model = keras.Model(inputs, noisy(inputs))
    with pytest.raises(
        ValueError,
        match=r"Layer 'noisy', chosen by argument `layers`, contains layers "
        r"that draw random numbers \(dropout",
    ):
        apply_recompute(model, "noisy", in_place=True)
    with pytest.raises(
        ValueError, match=r"Argument `layer` contains layers that draw random"
    ):
        RecomputeGrad(noisy)
    model = nested_model()
    with pytest.raises(ValueError, match="under tf_keras use in_place=False"):
        apply_recompute(model, "block", policy="sqrt", in_place=True)
    with pytest.raises(ValueError, match="under tf_keras use in_place=False"):
        apply_recompute(model, "block", policy="min_memory", in_place=True)
    with pytest.raises(ValueError, match="under tf_keras use in_place=False"):
        apply_recompute(model, in_place=True, group_by=lambda layer: 0)
    with pytest.raises(ValueError, match="Received: offload=True with backend"):
        apply_recompute(model, offload=True)


def _pruned_fit(in_place: bool):
    from keras_mgpu.callbacks.pruning_step_sync import PruningStepSync

    sparsity = pytest.importorskip("tensorflow_model_optimization").sparsity
    schedule = sparsity.keras.PolynomialDecay(
        0.0, 0.75, begin_step=0, end_step=3, frequency=1
    )
    keras.backend.clear_session()
    keras.utils.set_random_seed(1234)
    with make_strategy("mirrored_2").scope():
        block = keras.Sequential(
            [
                sparsity.keras.prune_low_magnitude(
                    keras.layers.Dense(16, activation="tanh"),
                    pruning_schedule=schedule,
                ),
                sparsity.keras.prune_low_magnitude(
                    keras.layers.Dense(16, activation="tanh"),
                    pruning_schedule=schedule,
                ),
            ],
            name="block",
        )
        inputs = keras.Input((X.shape[1],))
        model = keras.Model(inputs, keras.layers.Dense(1)(block(inputs)))
        if in_place:
            apply_recompute(model, "block", in_place=True)
        model.compile(
            GradientAccumulationOptimizer(keras.optimizers.SGD(0.05), 3),
            loss="mse",
        )
    model.fit(
        X,
        Y,
        batch_size=4,
        shuffle=False,
        verbose=0,
        callbacks=[PruningStepSync()],
    )
    return model, sparsity


def test_pruned_block_recomputed_in_place_prunes_like_plain():
    plain, _ = _pruned_fit(in_place=False)
    model, sparsity = _pruned_fit(in_place=True)
    assert [layer.name for layer in recomputed_layers(model)] == ["block"]
    assert_weights_close(model.get_weights(), plain.get_weights())
    masks = [
        layer.pruning_vars[0][1].numpy()
        for layer in model.get_layer("block").layers
    ]
    assert np.mean(masks[0] == 0) == pytest.approx(0.75, abs=0.02)
    assert strip_recompute(model) is model
    stripped = sparsity.keras.strip_pruning(model)
    np.testing.assert_allclose(
        stripped.predict(X, verbose=0), plain.predict(X, verbose=0), atol=1e-5
    )


@pytest.mark.parametrize("case", ["in_place", "wrapper"])
def test_train_step_runs_one_extra_forward_per_block(case):
    # tf_keras's recomputation restores the block's non-trainable state
    # (none here): the same op budget as Keras 3
    # (tests/layers/test_recompute_graph_size.py).
    from layers.graph_size import assert_one_extra_forward

    assert_one_extra_forward(case, ("in_place", "wrapper"))

"""Recompute in place and placement compose, in either order.

`apply_recompute(..., in_place=True)` switches layers (their `call`, or a
functional graph's runner for segments); `apply_placement` rebuilds the
model from its config, which carries none of that. Placement carries the
switches over: a layer switched inside a placed layer is switched in its
copy, a segment of the top-level graph becomes a segment of the placed
layers. Placing first and recomputing the placed model works as well
(`layers=None` searches the stages of a pipelined model).

Reference: the same placement of the plain model (same weights, same
dropout seed states), so micro-batches see the same masks and BatchNorm
statistics; forward passes are counted to see the recomputation run.
"""

from __future__ import annotations

import numpy as np
import pytest
from _placement_helpers import CPUS, assert_grads_close, loss_and_grads

from keras_mgpu import _flavour
from keras_mgpu.layers import apply_recompute, recomputed_layers
from keras_mgpu.layers.recompute_in_place import segment_plan
from keras_mgpu.placement import apply_placement, strip_placement

keras = _flavour.keras
tf = _flavour.tf

X = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")
Y = np.random.default_rng(1).normal(size=(8, 1)).astype("float32")


@keras.saving.register_keras_serializable(package="test_place_recompute")
class Counting(keras.layers.Layer):
    """Identity that counts its executions (eagerly)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.calls = 0

    def call(self, inputs):
        self.calls += 1
        return inputs


def residual_model() -> keras.Model:
    """Three residual blocks `b<k>_...` of a flat functional graph, with
    dropout, a head `block` (a Sequential, switched per layer) and an
    output layer."""
    keras.utils.set_random_seed(9)
    inputs = keras.Input((6,), name="x")
    x = keras.layers.Dense(6, name="stem")(inputs)
    for b in range(3):
        h = keras.layers.Dense(12, activation="relu", name=f"b{b}_fc1")(x)
        h = Counting(name=f"b{b}_count")(h)
        h = keras.layers.Dropout(0.2, name=f"b{b}_drop")(h)
        h = keras.layers.Dense(6, name=f"b{b}_fc2")(h)
        x = keras.layers.Add(name=f"b{b}_add")([x, h])
    head = keras.Sequential(
        [keras.layers.Dense(8, activation="tanh"), Counting(name="h_count")],
        name="head",
    )
    return keras.Model(inputs, keras.layers.Dense(1, name="out")(head(x)))


def block_key(layer):
    return (
        layer.name.split("_")[0]
        if layer.name[:2] in {"b0", "b1", "b2"}
        else None
    )


def switch(model):
    """Blocks as segments (group_by), the head per layer."""
    apply_recompute(model, in_place=True, group_by=block_key)
    apply_recompute(model, "head", in_place=True)
    return model


def place(model, micro_batches):
    return apply_placement(
        model, CPUS[:2], policy=["b1_fc1"], micro_batches=micro_batches
    )


def counts(model) -> dict:
    found = {}
    for layer in model._flatten_layers():
        if isinstance(layer, Counting):
            found[layer.name] = layer.calls
            layer.calls = 0
    return found


def names(model) -> list:
    return sorted(layer.name for layer in recomputed_layers(model))


def check_step(model, reference, micro_batches) -> None:
    """One eager step, then one under tf.function: gradients equal the
    reference's; eagerly each counted layer runs twice per micro-batch
    (forward, recomputation), against once in the reference."""
    counts(model), counts(reference)
    x, y = tf.constant(X), Y
    for _ in range(2):  # dropout seed states advance alike
        loss, grads = loss_and_grads(model, x, y)
        expected_loss, expected = loss_and_grads(reference, x, y)
        assert loss == pytest.approx(expected_loss, rel=1e-6)
        assert_grads_close(grads, expected)
    per_step = micro_batches or 1
    assert set(counts(model).values()) == {2 * 2 * per_step}
    assert set(counts(reference).values()) == {2 * per_step}
    # Under tf.function (where micro-batch groups sum weight gradients).
    assert_grads_close(
        [np.asarray(g) for g in tf.function(_tape_grads)(model, x, y)],
        [np.asarray(g) for g in tf.function(_tape_grads)(reference, x, y)],
    )


def _tape_grads(model, x, y):
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(tf.square(model(x, training=True) - y))
    return tape.gradient(loss, model.trainable_variables)


@pytest.mark.parametrize("micro_batches", [None, 2], ids=["plain", "pipelined"])
def test_recompute_then_place(micro_batches):
    model = switch(residual_model())
    expected_names = names(model)
    assert len(expected_names) == 16  # 3 blocks of 5, and the head
    placed = place(model, micro_batches)
    assert names(placed) == expected_names
    reference = place(residual_model(), micro_batches)
    assert names(reference) == []
    check_step(placed, reference, micro_batches)
    # strip_placement keeps the switches too.
    plain = strip_placement(placed)
    assert names(plain) == expected_names
    check_step(plain, strip_placement(reference), None)


def test_min_memory_segments_survive_placement():
    """policy="min_memory" over the blocks' layers (segments across the
    residual adds), the head per layer: placed and pipelined, the same
    layers stay recomputed and the gradients are the plain placement's."""
    model = residual_model()
    apply_recompute(
        model,
        lambda layer: layer.name[:2] in {"b0", "b1", "b2"},
        policy="min_memory",
    )
    apply_recompute(model, "head")
    plan = segment_plan(model)
    # Measured plan: b0 whole, b1 without its add, then [b1_add, b2_fc1,
    # b2_count] and [b2_drop, b2_fc2, b2_add]: segments across blocks.
    assert [len(segment) for segment in plan] == [5, 4, 3, 3]
    expected_names = names(model)
    placed = place(model, 2)
    assert names(placed) == expected_names
    check_step(placed, place(residual_model(), 2), 2)


def test_place_then_recompute_a_pipelined_model():
    placed = place(residual_model(), 2)
    switch(placed)  # the blocks sit in the stages model: layers=None finds them
    assert names(placed) == names(switch(residual_model()))
    check_step(placed, place(residual_model(), 2), 2)


def mobilenet_block(layer):
    """Per inverted-residual block of MobileNetV2 (`block_<k>_...`)."""
    return layer.name.split("_")[1] if layer.name.startswith("block_") else None


def test_mobilenet_v2_recompute_survives_placement_in_both_orders():
    """The issue's case: MobileNetV2 recomputed per block, placed on 2
    devices with 2 micro-batches."""

    def mobilenet():
        keras.utils.set_random_seed(2)
        return keras.applications.MobileNetV2(
            input_shape=(32, 32, 3), alpha=0.35, weights=None, classes=3
        )

    model = apply_recompute(
        mobilenet(), in_place=True, group_by=mobilenet_block
    )
    recomputed = names(model)
    assert len(recomputed) == 142
    placed = apply_placement(model, CPUS[:2], micro_batches=2)
    assert names(placed) == recomputed
    placed = apply_placement(mobilenet(), CPUS[:2], micro_batches=2)
    apply_recompute(placed, in_place=True, group_by=mobilenet_block)
    assert names(placed) == recomputed


def test_rebuilding_a_placed_model_is_refused():
    placed = place(residual_model(), 2)
    with pytest.raises(
        ValueError,
        match=r"is placed \(`apply_placement`\); a rebuild would wrap .* "
        r"Pass in_place=True .* Received: in_place=False",
    ):
        apply_recompute(placed, "head", in_place=False)


@pytest.mark.parametrize("micro_batches", [None, 2], ids=["plain", "pipelined"])
def test_selective_recompute_survives_placement(micro_batches):
    """policy="selective" on the head (a Sequential of Dense + tanh):
    placed, pipelined or not, and stripped again, the head stays
    selectively recomputed and the gradients are the plain placement's."""
    model = residual_model()
    apply_recompute(model, "head", policy="selective")
    expected_names = names(model)
    assert expected_names
    placed = place(model, micro_batches)
    assert names(placed) == expected_names
    reference = place(residual_model(), micro_batches)
    x = tf.constant(X)
    for _ in range(2):
        loss, grads = loss_and_grads(placed, x, Y)
        expected_loss, expected = loss_and_grads(reference, x, Y)
        assert loss == pytest.approx(expected_loss, rel=1e-6)
        assert_grads_close(grads, expected)
    assert names(strip_placement(placed)) == expected_names

"""PlacedLayer: variables, forward and backward ops on its device (read
from TensorFlow's placed graphs), masks, serialization."""

from __future__ import annotations

import numpy as np
import pytest
from _placement_helpers import (
    CPUS,
    canonical,
    compute_op,
    data,
    device_of,
    placed_nodes,
    stage_cuts,
    staged_mlp,
)

from keras_mgpu import _flavour
from keras_mgpu.placement import PlacedLayer, apply_placement

keras = _flavour.keras
tf = _flavour.tf


def test_forward_and_backward_ops_run_on_the_stage_device():
    """Every Dense op of stage k, forward and gradient, ran on device k.

    Without the placed gradient (`tf.device` in `call` only), TensorFlow
    puts every gradient op on the default device: this test fails then.
    """
    model = staged_mlp(3, name="placed_ops_probe")
    devices = CPUS[1:4]  # cpu:0 stays the host, so a stray op shows
    placed = apply_placement(model, devices, policy=stage_cuts(model))
    x, y = data()

    @tf.function
    def step(x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(placed(x, training=True) - y))
        return tape.gradient(loss, placed.trainable_variables)

    nodes = placed_nodes(lambda: step(tf.constant(x), tf.constant(y)))
    # Ops are told apart by kind (oneDNN's kernels and fused matmuls
    # included, see `compute_op`), stage (the layer's name scope) and
    # direction (the tape's name scope), never by exact kernel names: with
    # oneDNN on, the forward is one fused matmul per Dense layer.
    seen = {k: {"forward": set(), "backward": set()} for k in range(3)}
    for node in nodes:
        kind = compute_op(node.op)
        if kind is None or "placed_ops_probe" not in node.name:
            continue
        stage = next((k for k in range(3) if f"/s{k}_" in node.name), None)
        if stage is None:
            continue
        assert canonical(node.device) == canonical(devices[stage]), (
            node.name,
            node.op,
            node.device,
        )
        direction = "backward" if "gradient_tape" in node.name else "forward"
        seen[stage][direction].add(kind)
    for stage, kinds in seen.items():
        # Each stage's matmuls ran on its device, both ways.
        assert kinds["forward"] & {"MatMul", "FusedMatMul"}, (stage, seen)
        assert "MatMul" in kinds["backward"], (stage, seen)


def test_variables_are_created_on_the_device():
    layer = PlacedLayer(keras.layers.Dense(4, name="d"), "/cpu:2")
    layer.build((None, 3))
    assert [device_of(v) for v in layer.weights] == ["/device:CPU:2"] * 2
    drop = PlacedLayer.from_config(
        PlacedLayer(keras.layers.Dropout(0.5, seed=1), "cpu:3").get_config()
    )
    # The seed state is made in Dropout's __init__, inside from_config.
    assert [device_of(v) for v in drop.layer.variables] == ["/device:CPU:3"]


def test_config_round_trip_and_defaults():
    layer = PlacedLayer(keras.layers.Dense(4, name="head"), "GPU:1")
    assert layer.name == "head" and layer.device == "/device:GPU:1"
    assert not layer.supports_jit
    config = layer.get_config()
    clone = PlacedLayer.from_config(config)
    assert clone.device == "/device:GPU:1"
    assert clone.layer.get_config()["units"] == 4


def test_masks_pass_through_placed_layers():
    keras.utils.set_random_seed(3)
    inputs = keras.Input((5,), dtype="int32")
    x = keras.layers.Embedding(10, 4, mask_zero=True, name="embed")(inputs)
    x = keras.layers.GlobalAveragePooling1D(name="pool")(x)
    outputs = keras.layers.Dense(2, name="head")(x)
    model = keras.Model(inputs, outputs)
    placed = apply_placement(model, CPUS[:2], policy=["pool"])
    ids = np.array([[1, 2, 0, 0, 0], [3, 0, 0, 0, 0]], dtype="int32")
    np.testing.assert_allclose(placed(ids), model(ids), rtol=1e-6, atol=1e-7)
    # The mask matters: the unmasked mean differs.
    unmasked = keras.layers.GlobalAveragePooling1D()(
        model.get_layer("embed")(ids).numpy()
    )
    assert not np.allclose(
        unmasked, model.get_layer("pool")(model.get_layer("embed")(ids))
    )


@pytest.mark.parametrize(
    "layer, device, error, match",
    [
        (
            "not a layer",
            "/cpu:0",
            TypeError,
            "Argument `layer` must be a Keras layer",
        ),
        (
            None,
            "nonsense::",
            ValueError,
            "Argument `device` must hold device names",
        ),
        (None, "/cpu", ValueError, "Argument `device` must name one device"),
        (None, 3, TypeError, "Argument `device` must hold device names"),
    ],
)
def test_bad_arguments(layer, device, error, match):
    layer = keras.layers.Dense(2) if layer is None else layer
    with pytest.raises(error, match=match):
        PlacedLayer(layer, device)


def test_placing_a_placed_layer_twice_is_refused():
    inner = PlacedLayer(keras.layers.Dense(2), "/cpu:0")
    with pytest.raises(ValueError, match="already a PlacedLayer"):
        PlacedLayer(inner, "/cpu:1")

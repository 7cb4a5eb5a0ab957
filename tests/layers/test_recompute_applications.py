"""In-place recompute per residual stage / block of `keras.applications`
models (flat functional graphs, weights=None, 32x32 inputs).

Reference: the same model before the switch, with every variable (weights,
BatchNormalization statistics, dropout seed states) put back between the
two runs. Outputs and gradients are compared bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_recompute_in_place import assert_identical, step

from keras_mgpu import _flavour
from keras_mgpu.layers import (
    apply_recompute,
    recomputed_layers,
    strip_recompute,
)
from keras_mgpu.layers.recompute_in_place import segment_plan

keras = _flavour.keras
tf = _flavour.tf

IMAGES = np.random.default_rng(0).normal(size=(4, 32, 32, 3)).astype("float32")
LABELS = np.array([0, 1, 2, 1])


def resnet_stage(layer):
    """conv2_block1_1_conv -> conv2: the 4 residual stages (and the stem)."""
    return layer.name.split("_")[0]


def mobilenet_block(layer):
    """block_3_expand -> block_3: the inverted residual blocks."""
    parts = layer.name.split("_")
    return "_".join(parts[:2]) if parts[0] == "block" else None


def efficientnet_block(layer):
    """block2a_expand_conv -> block2a: the MBConv blocks."""
    name = layer.name.split("_")[0]
    return name if name.startswith("block") else None


MODELS = {
    "resnet50": (keras.applications.ResNet50, {}, resnet_stage, 6),
    "mobilenet_v2": (
        keras.applications.MobileNetV2,
        {"alpha": 0.35},
        mobilenet_block,
        16,
    ),
    "efficientnet_b0": (
        keras.applications.EfficientNetB0,
        {},
        efficientnet_block,
        16,
    ),
}


def build(name: str):
    constructor, options, _, _ = MODELS[name]
    keras.utils.set_random_seed(1)
    return constructor(
        weights=None, input_shape=(32, 32, 3), classes=3, **options
    )


@pytest.mark.parametrize("name", list(MODELS))
def test_per_block_recompute_is_bit_identical(name):
    _, _, key, segments = MODELS[name]
    model = build(name)
    config = model.get_config()
    state = [v.numpy() for v in model.variables]
    expected = step(model, IMAGES)
    for variable, value in zip(model.variables, state, strict=True):
        variable.assign(value)
    assert apply_recompute(model, in_place=True, group_by=key) is model
    assert len(segment_plan(model)) == segments
    assert type(model).__name__ == "Functional"
    assert model.get_config() == config
    assert_identical(step(model, IMAGES), expected)
    strip_recompute(model)
    assert recomputed_layers(model) == []


@pytest.mark.slow
def test_mobilenet_per_block_fits():
    # Segments under MirroredStrategy: the GPT-2 fit in
    # test_recompute_keras_hub.py.
    model = build("mobilenet_v2")
    apply_recompute(model, in_place=True, group_by=mobilenet_block)
    model.compile(
        keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(),
    )
    before = [v.numpy() for v in model.trainable_variables]
    history = model.fit(IMAGES, LABELS, batch_size=2, epochs=1, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    moved = [
        not np.array_equal(a, v.numpy())
        for a, v in zip(before, model.trainable_variables, strict=True)
    ]
    assert all(moved)
    assert len(segment_plan(model)) == 16

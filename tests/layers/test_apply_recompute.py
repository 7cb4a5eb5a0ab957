"""apply_recompute / strip_recompute: wrap chosen layers of a whole model."""

from __future__ import annotations

import os

import numpy as np
import pytest

from keras_mgpu import _flavour
from keras_mgpu.layers import RecomputeGrad, apply_recompute, strip_recompute

keras = _flavour.keras
tf = _flavour.tf


def dense_stack(n: int = 9) -> keras.Sequential:
    layers = [
        keras.layers.Dense(6, activation="tanh", name=f"d{i}") for i in range(n)
    ]
    return keras.Sequential(
        [keras.Input((6,), name="x")]
        + layers
        + [keras.layers.Dropout(0.2, seed=1, name="drop")]
        + [keras.layers.Dense(1, name="out")],
        name="stack",
    )


def functional_chain(n: int = 4) -> keras.Model:
    inputs = keras.Input((6,), name="x")
    h = inputs
    for i in range(n):
        h = keras.layers.Dense(6, activation="relu", name=f"f{i}")(h)
    return keras.Model(inputs, h, name="chain")


X = np.random.default_rng(0).normal(size=(8, 6)).astype("float32")


def _same_predictions(a, b):
    np.testing.assert_array_equal(a(X).numpy(), b(X).numpy())


def _wrapped_names(model):
    return [
        layer.layer.name
        for layer in model.layers
        if isinstance(layer, RecomputeGrad)
    ]


@pytest.mark.parametrize(
    "selector,expected",
    [
        (None, [f"d{i}" for i in range(9)] + ["drop", "out"]),
        ("d3", ["d3"]),
        (["d1", "out"], ["d1", "out"]),
        (keras.layers.Dropout, ["drop"]),
        (lambda layer: layer.name.endswith("7"), ["d7"]),
        (["d0", keras.layers.Dropout], ["d0", "drop"]),
    ],
    ids=["all", "name", "names", "class", "predicate", "mixed"],
)
def test_per_layer_selection(selector, expected):
    model = dense_stack()
    remat = apply_recompute(model, layers=selector, in_place=False)
    assert _wrapped_names(remat) == expected
    assert remat is not model and not _wrapped_names(model)
    _same_predictions(model, remat)
    if selector == "d3":
        assert remat.get_layer("recompute_d3").layer.name == "d3"


def test_sqrt_policy_segments_and_strip_is_inverse(tmp_path):
    model = dense_stack(16)  # 16 Dense blocks + dropout + out
    remat = apply_recompute(model, policy="sqrt", in_place=False)
    sizes = [len(layer.layer.layers) for layer in remat.layers]
    assert sizes == [5, 5, 5, 3]  # n = 18 chosen, ceil(sqrt(18)) = 5
    assert all(isinstance(layer, RecomputeGrad) for layer in remat.layers)
    _same_predictions(model, remat)
    # Only Dense blocks: the Dropout breaks nothing, it is just not chosen.
    dense_only = apply_recompute(
        model, keras.layers.Dense, policy="sqrt", in_place=False
    )
    assert [type(layer).__name__ for layer in dense_only.layers][-2:] == [
        "Dropout",
        "RecomputeGrad",
    ]
    plain = strip_recompute(remat)
    assert [layer.name for layer in plain.layers] == [
        layer.name for layer in model.layers
    ]
    assert type(plain) is type(model)
    _same_predictions(model, plain)
    # Trains and saves like the original.
    remat.compile(optimizer="sgd", loss="mse")
    remat.fit(X, X[:, :1], epochs=1, verbose=0)
    path = os.path.join(tmp_path, "sqrt.keras")
    remat.save(path)
    loaded = keras.models.load_model(path)
    _same_predictions(remat, loaded)


def test_functional_chain_sqrt_and_per_layer():
    model = functional_chain(4)
    remat = apply_recompute(model, policy="sqrt", in_place=False)
    assert [len(layer.layer.layers) for layer in remat.layers[1:]] == [2, 2]
    _same_predictions(model, remat)
    assert [layer.name for layer in strip_recompute(remat).layers] == [
        layer.name for layer in model.layers
    ]
    per_layer = apply_recompute(model, layers=["f1", "f2"], in_place=False)
    assert _wrapped_names(per_layer) == ["f1", "f2"]
    _same_predictions(model, per_layer)
    _same_predictions(model, strip_recompute(per_layer))


def test_already_wrapped_layers_are_skipped():
    model = dense_stack(3)
    once = apply_recompute(model, layers="d1", in_place=False)
    twice = apply_recompute(once, layers=keras.layers.Layer, in_place=False)
    assert all(
        not isinstance(layer.layer, RecomputeGrad)
        for layer in twice.layers
        if isinstance(layer, RecomputeGrad)
    )
    _same_predictions(model, twice)
    with pytest.raises(ValueError, match="No layer of model"):
        apply_recompute(once, layers="recompute_d1", in_place=False)


def test_non_chain_functional_rejects_sqrt():
    inputs = keras.Input((6,))
    a = keras.layers.Dense(6)(inputs)
    outputs = keras.layers.Add()([a, keras.layers.Dense(6)(inputs)])
    model = keras.Model(inputs, outputs)
    with pytest.raises(ValueError, match="policy='sqrt' needs a sequential"):
        apply_recompute(model, policy="sqrt", in_place=False)
    remat = apply_recompute(model, layers=keras.layers.Dense, in_place=False)
    assert len(_wrapped_names(remat)) == 2
    _same_predictions(model, remat)


def test_bad_arguments():
    class Subclassed(keras.Model):
        def __init__(self):
            super().__init__()
            self.dense = keras.layers.Dense(1)

        def call(self, inputs):
            return self.dense(inputs)

    with pytest.raises(ValueError, match="cannot rebuild a subclassed model"):
        apply_recompute(Subclassed(), in_place=False)
    with pytest.raises(ValueError, match="cannot rebuild a subclassed model"):
        strip_recompute(Subclassed())
    with pytest.raises(TypeError, match="Received: model=<Dense"):
        apply_recompute(keras.layers.Dense(2), in_place=False)
    model = dense_stack(2)
    with pytest.raises(ValueError, match=r"does not have: \['nope'\]"):
        apply_recompute(model, layers=["nope"], in_place=False)
    with pytest.raises(ValueError, match="Received: policy='best'"):
        apply_recompute(model, policy="best", in_place=False)
    with pytest.raises(TypeError, match="Received: layers=3"):
        apply_recompute(model, layers=3, in_place=False)
    with pytest.raises(TypeError, match="with item 3"):
        apply_recompute(model, layers=["d0", 3], in_place=False)

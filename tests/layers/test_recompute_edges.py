"""In-place recompute at its edges, written once and run on each backend
(TensorFlow and JAX):

- Layers built under `keras.RematScope(mode="full")` and then switched by
  `apply_recompute` train as the plain model (Keras's own per-layer remat is
  taken over): per layer, after a `predict()`, `group_by`, `policy="sqrt"`
  and `policy="selective"`. Reference: the plain model from the same
  weights, weights compared after 3 `fit` steps.
- `policy="selective"` saves nothing of the switch: `get_config` and a
  `.keras` file's config are the plain model's for an activation given as a
  layer object, a registered custom function, a string and a plain
  function; the file loads without keras_mgpu and trains as the switched
  model.
"""

from __future__ import annotations

import json
import os
import zipfile

import numpy as np
import pytest

from keras_mgpu import _flavour
from keras_mgpu.layers import (
    apply_recompute,
    recomputed_layers,
    strip_recompute,
)

pytestmark = pytest.mark.backends("tensorflow", "jax")

keras = _flavour.keras

ON_JAX = keras.backend.backend() == "jax"
FEATURES = 8
X = np.random.default_rng(0).normal(size=(32, FEATURES)).astype("float32")
Y = np.random.default_rng(1).normal(size=(32, FEATURES)).astype("float32")
STEPS = 3


def _fit(model: keras.Model, predict_first: bool = False) -> list:
    model.compile(keras.optimizers.SGD(0.1), "mse")
    if predict_first:
        model.predict(X, batch_size=8, verbose=0)
    model.fit(
        X,
        Y,
        batch_size=8,
        epochs=1,
        steps_per_epoch=STEPS,
        shuffle=False,
        verbose=0,
    )
    return [np.asarray(w) for w in model.get_weights()]


# ---------------------------------------------------------------------------
# keras.RematScope + apply_recompute(in_place=True)
# ---------------------------------------------------------------------------


def _chain(layers: int, in_scope: bool, norm: bool) -> keras.Model:
    """A Dense-tanh chain, its layers built under `RematScope("full")`.

    On JAX the model itself is built in the scope too (as a user would);
    on TensorFlow Keras's own remat of the whole model fails in graph mode
    (`tf.recompute_grad` with keyword arguments, keras-facts.md), whatever
    keras_mgpu does, so there only the layers are.
    """
    scope = keras.RematScope(mode="full" if in_scope else None)
    with scope:
        inputs = keras.Input((FEATURES,))
        x = inputs
        for i in range(layers - 1):
            x = keras.layers.Dense(FEATURES, name=f"dense_{i}")(x)
            if norm:
                x = keras.layers.LayerNormalization(name=f"norm_{i}")(x)
            x = keras.layers.Activation("tanh", name=f"tanh_{i}")(x)
        x = keras.layers.Dense(FEATURES, activation="tanh", name="last")(x)
    with keras.RematScope(mode="full" if in_scope and ON_JAX else None):
        return keras.Model(inputs, x)


# name: (layers in the chain, apply_recompute kwargs, predict first,
# normalization layers). Each case has a layer with weights switched on its
# own, where Keras's remat wrapped the switched call: on JAX the first trace
# was reused with its weights baked in (zero gradients) or its tracers
# leaked (`UnexpectedTracerError`); TensorFlow failed in graph mode.
REMAT_CASES = {
    "per_layer": (2, {}, False, False),
    "per_layer_after_predict": (2, {}, True, False),
    # The first four layers as one unit, "last" on its own.
    "group_by": (
        3,
        {"group_by": lambda layer: layer.name == "last"},
        False,
        False,
    ),
    # 3 units in segments of 2 and 1.
    "sqrt": (2, {"policy": "sqrt"}, False, False),
    # Activation layers (and on JAX normalization layers) switched per
    # layer, the Dense activation wrapped, the rest taken over.
    "selective": (2, {"policy": "selective"}, False, True),
}


@pytest.mark.parametrize("case", sorted(REMAT_CASES))
def test_remat_scope_layers_train_as_plain(case):
    layers, kwargs, predict_first, norm = REMAT_CASES[case]
    plain = _chain(layers, in_scope=False, norm=norm)
    initial = plain.get_weights()
    model = _chain(layers, in_scope=True, norm=norm)
    model.set_weights(initial)
    modes = {layer.name: layer._remat_mode for layer in model.layers}
    assert modes["last"] is not None  # Keras's private attribute still read

    apply_recompute(model, **kwargs)
    assert recomputed_layers(model)
    expected = _fit(plain)
    got = _fit(model, predict_first)

    moved = max(np.abs(a - b).max() for a, b in zip(expected, initial))
    assert moved > 1e-3, moved  # the reference trains
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)
    # strip_recompute gives Keras's remat mode back.
    strip_recompute(model)
    assert {layer.name: layer._remat_mode for layer in model.layers} == modes


# ---------------------------------------------------------------------------
# policy="selective": nothing of the switch is saved.
# ---------------------------------------------------------------------------


@keras.saving.register_keras_serializable(package="keras_mgpu_tests")
def squared_relu(x):
    return keras.ops.square(keras.ops.relu(x))


def half_tanh(x):
    return 0.5 * keras.ops.tanh(x)


ACTIVATIONS = {
    "layer_object": lambda: keras.layers.LeakyReLU(0.2, name="leaky"),
    "registered": lambda: squared_relu,
    "string": lambda: "gelu",
    "plain_function": lambda: half_tanh,
}


def _saved_config(model: keras.Model, path: str) -> dict:
    model.save(path)
    with zipfile.ZipFile(path) as archive:
        return json.loads(archive.read("config.json"))


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_selective_saves_the_plain_config(activation, tmp_path):
    inputs = keras.Input((FEATURES,), name="x")
    hidden = keras.layers.Dense(
        FEATURES, activation=ACTIVATIONS[activation](), name="hidden"
    )(inputs)
    outputs = keras.layers.Dense(FEATURES, name="out")(hidden)
    model = keras.Model(inputs, outputs, name="selective_saving")
    plain_config = json.dumps(model.get_config(), sort_keys=True)
    plain_saved = _saved_config(model, os.path.join(tmp_path, "plain.keras"))

    apply_recompute(model, policy="selective")
    assert json.dumps(model.get_config(), sort_keys=True) == plain_config
    path = os.path.join(tmp_path, "switched.keras")
    assert _saved_config(model, path) == plain_saved

    loaded = keras.saving.load_model(
        path, custom_objects={"half_tanh": half_tanh}
    )
    assert recomputed_layers(loaded) == []
    assert recomputed_layers(model)  # saving leaves the switch on
    # The loaded (plain) model and the switched one train alike.
    expected = _fit(loaded)
    for a, b in zip(_fit(model), expected, strict=True):
        np.testing.assert_allclose(a, b, atol=1e-6, rtol=0)

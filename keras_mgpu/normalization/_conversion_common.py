"""What the BatchNormalization remedies of `conversions` share: argument
checks, the layers a model holds (or a warning where it holds none), and
refreshing a compiled model after its layers changed."""

from __future__ import annotations

import warnings
from typing import Any

from keras_mgpu._flavour import keras_of, object_flavour
from keras_mgpu.normalization._find import (
    batchnorm_layers,
)


# ----------------------------------------------------------------------
# Shared helpers
# ----------------------------------------------------------------------
def _check_bool(value: object, argument: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(
            f"Argument `{argument}` must be True or False. Received: "
            f"{argument}={value!r} (of type {type(value).__name__})"
        )
    return value


def _keras_for(model: object, argument: str = "model") -> Any:
    """The Keras package `model` belongs to, or a TypeError when it is not
    a Keras layer or model of either flavour."""
    flavour = object_flavour(model)
    if flavour in ("keras3", "tf_keras"):
        keras = keras_of(flavour)
        if isinstance(model, keras.layers.Layer):
            return keras
    raise TypeError(
        f"Argument `{argument}` must be a Keras model or layer (Keras 3 or "
        f"tf_keras). Received: {argument}={model!r} (of type "
        f"{type(model).__name__})"
    )


def _layers_or_warn(model: Any, function: str) -> list:
    """The BatchNormalization layers of `model`; a UserWarning (and an
    empty list) when it has none: the call is then a no-op, most likely
    on the wrong object (e.g. a layer whose sublayers Keras does not
    track)."""
    layers = batchnorm_layers(model)
    if not layers:
        warnings.warn(
            f"`{function}`: model {getattr(model, 'name', model)!r} has no "
            "BatchNormalization layers (nested models and tracked "
            "sublayers included); nothing was changed.",
            UserWarning,
            stacklevel=3,
        )
    return layers


def _refresh_compiled(model: Any) -> None:
    """Make a compiled model (and compiled models inside it) trace its
    step functions anew, with the layers' current flags.

    Both flavours read a layer's `trainable` and BatchNormalization's
    `synchronized` when they trace `train_function`, and cache the traced
    function: without this, a change after `fit` started takes effect only
    after `compile` again. Private API, isolated here (Keras 3.10-3.15:
    `train_function`/`test_function`/`predict_function` and the
    `_compiled_trainable_state` that `fit` compares against to warn;
    tf_keras 2.15-2.21: `_reset_compile_cache`, which also records the
    trainable state that its `fit` would otherwise restore).
    """
    models = [model] + [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if hasattr(layer, "make_train_function")
    ]
    for each in models:
        if not hasattr(each, "make_train_function"):
            continue
        reset = getattr(each, "_reset_compile_cache", None)
        if reset is not None:  # tf_keras
            if getattr(each, "_is_compiled", False):
                reset()
            continue
        if not getattr(each, "compiled", False):
            continue
        each.train_function = None
        each.test_function = None
        each.predict_function = None
        if hasattr(each, "_compiled_trainable_state"):
            each._compiled_trainable_state = {
                layer: layer.trainable for layer in each._flatten_layers()
            }


def _unknown_to_optimizer(model: Any, variables: list) -> list:
    """Those of `variables` that the compiled model's optimizer, already
    built, was not built with (it refuses to update them: Keras 3 raises
    "Unknown variable", tf_keras a KeyError). Private API, isolated here
    (Keras 3.10-3.15: `_trainable_variables`; tf_keras 2.15-2.21:
    `_var_key` and `_index_dict`); [] when it cannot tell."""
    optimizer = getattr(model, "optimizer", None)
    try:
        if optimizer is None:
            return []
        if hasattr(optimizer, "_index_dict"):  # tf_keras
            if not getattr(optimizer, "_built", False):
                return []
            known = optimizer._index_dict
            return [v for v in variables if optimizer._var_key(v) not in known]
        if not optimizer.built:
            return []
        known_ids = {id(v) for v in optimizer._trainable_variables}
        return [v for v in variables if id(v) not in known_ids]
    except Exception:  # noqa: BLE001 - only a hint
        return []

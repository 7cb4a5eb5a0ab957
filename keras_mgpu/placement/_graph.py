"""What placement needs to know about a model's graph: which layers can be
placed, in which order, how big they are, and what flows between them.

Keras 3 only; read from public attributes and `get_config()` where Keras
offers them (see `_is_functional` and `_producers` for the two private
spots).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_mgpu._flavour import check_flavour, keras_of, object_flavour
from keras_mgpu._layer_calls import accepts
from keras_mgpu.backend import ON_JAX_PLACEMENT, require_backend

# Placement is Keras 3 only, whatever TF_USE_LEGACY_KERAS says.
keras = keras_of("keras3")


def is_functional(model: Any) -> bool:
    """True for a functional (graph) model, False for a subclassed one.

    Keras 3.15 does not export its `Functional` class (private import).
    """
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


def check_model(model: Any, function: str) -> None:
    """Raise unless Keras runs on TensorFlow (placement is TensorFlow's
    device placement; the error names the JAX way) and `model` is a built
    Sequential or functional Keras 3 model (errors name the argument
    `model`): what every public placement function checks first."""
    require_backend(function, ("tensorflow",), instead=ON_JAX_PLACEMENT)
    if object_flavour(model) == "tf_keras":
        raise NotImplementedError(
            f"`keras_mgpu.{function}` needs Keras 3 (TensorFlow backend); it "
            "is not available under tf_keras (TF_USE_LEGACY_KERAS=1): give it "
            f"a Keras 3 model. Received: model={model.name!r} (tf_keras)"
        )
    check_flavour(model, "model", "keras3")
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`{function}` expects a Sequential or functional keras.Model "
            "as argument `model`. Received: "
            f"model={model!r} (of type {type(model).__name__})"
        )
    if not isinstance(model, keras.Sequential) and not is_functional(model):
        raise ValueError(
            f"`{function}` cannot place a subclassed model: its layers are "
            "wired in Python code (`call`), not in a graph it can cut into "
            "stages. Build the model with the functional API or "
            "`keras.Sequential`, or place its blocks yourself with "
            "`keras_mgpu.placement.PlacedLayer(block, device)`. Received: "
            f"model={model.name!r} (of type {type(model).__name__})"
        )
    if not model.built or not getattr(model, "inputs", None):
        raise ValueError(
            f"`{function}` needs a built model with known inputs: give a "
            "Sequential model a `keras.Input(shape)` first (or build it). "
            f"Received: model={model.name!r} (not built)"
        )


def as_functional(model: Any) -> Any:
    """A functional model over the same layers (a Sequential is rewired)."""
    if isinstance(model, keras.Sequential):
        return keras.Model(model.inputs[0], model.outputs[0], name=model.name)
    return model


def producer(tensor: Any) -> Any:
    """The layer that made a symbolic tensor (Keras 3.15 keeps it in the
    tensor's `_keras_history`, which Keras's own cloning reads)."""
    return tensor._keras_history[0]


def rebuild(model: Any, clone_function: Any) -> Any:
    """`keras.models.clone_model` of a functional model that keeps input
    names and passes `mask` only to layers that take it (a wrapper's call
    records `mask=None`, which the unwrapped layer may not accept)."""
    inputs = keras.tree.map_structure(
        lambda x: keras.Input(
            batch_shape=x.shape, dtype=x.dtype, name=producer(x).name
        ),
        model.input,
    )

    def call_function(layer: Any, *args: Any, **kwargs: Any) -> Any:
        if "mask" in kwargs and not accepts(layer, "mask"):
            kwargs.pop("mask")
        return layer(*args, **kwargs)

    return keras.models.clone_model(
        model,
        input_tensors=inputs,
        clone_function=clone_function,
        call_function=call_function,
    )


def is_input_layer(layer: Any) -> bool:
    return isinstance(layer, keras.layers.InputLayer)


def units(model: Any) -> list:
    """The placeable layers in graph order (inputs excluded)."""
    return [layer for layer in model.layers if not is_input_layer(layer)]


def param_bytes(layer: Any) -> int:
    """Bytes of the layer's weights (trainable and not)."""
    return int(
        sum(
            int(np.prod(v.shape)) * np.dtype(v.dtype).itemsize
            for v in layer.weights
        )
    )


def param_count(layer: Any) -> int:
    return int(sum(int(np.prod(v.shape)) for v in layer.weights))


def output_bytes(layer: Any) -> int:
    """Bytes per example of the layer's output(s), 0 when unknown."""
    try:
        outputs = keras.tree.flatten(layer.output)
    except (AttributeError, ValueError):
        return 0
    total = 0
    for tensor in outputs:
        dims = [d for d in tensor.shape[1:]]
        if any(d is None for d in dims):
            dims = [1 if d is None else d for d in dims]
        total += int(np.prod(dims)) * np.dtype(tensor.dtype).itemsize
    return total


def _history_names(obj: Any, names: list) -> None:
    # Keras 3 config: tensors are {"class_name": "__keras_tensor__",
    # "config": {..., "keras_history": [name, node_index, tensor_index]}}.
    if isinstance(obj, dict):
        config = obj.get("config")
        if isinstance(config, dict) and "keras_history" in config:
            names.append(config["keras_history"][0])
            return
        for value in obj.values():
            _history_names(value, names)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _history_names(value, names)


def producers(model: Any) -> dict[str, list[str]]:
    """For each layer name, the names of the layers feeding it.

    Read from the functional config's `inbound_nodes` (Keras 3.15 format).
    """
    config = as_functional(model).get_config()
    result = {}
    for layer_config in config["layers"]:
        names: list = []
        _history_names(layer_config.get("inbound_nodes") or [], names)
        result[layer_config["config"]["name"]] = names
    return result


def cut_costs(model: Any, placeable: list) -> list[int]:
    """`costs[j]`: bytes per example that cross a cut made just before
    `placeable[j]` (outputs of earlier layers used at or after j)."""
    index = {layer.name: i for i, layer in enumerate(placeable)}
    last_use = [-1] * len(placeable)
    for consumer, feeding in producers(model).items():
        if consumer not in index:
            continue
        for name in feeding:
            if name in index:
                last_use[index[name]] = max(
                    last_use[index[name]], index[consumer]
                )
    sizes = [output_bytes(layer) for layer in placeable]
    costs = [0] * len(placeable)
    for j in range(1, len(placeable)):
        costs[j] = sum(sizes[p] for p in range(j) if last_use[p] >= j)
    return costs

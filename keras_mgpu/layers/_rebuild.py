"""Rebuild a Sequential or functional model with chosen layers wrapped in
`RecomputeGrad` (`apply_recompute(..., in_place=False)`), and back.

In the manner of TFMOT's `prune_low_magnitude` / `strip_pruning`: the model
is rebuilt (never modified) with `keras.models.clone_model` or, for the sqrt
policy, as a chain of segments; weights are carried over layer by layer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mgpu._flavour import IS_TF_KERAS, keras
from keras_mgpu.layers.recompute_grad import RecomputeGrad

SEGMENT_PREFIX = "recompute_segment"


def is_functional(model: Any) -> bool:
    """True for a functional (graph) model, False for a subclassed one.

    Keras 3.15 does not export its `Functional` class; tf_keras 2.x marks
    graph networks with `_is_graph_network`. Both are private.
    """
    if IS_TF_KERAS:
        return bool(getattr(model, "_is_graph_network", False))
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


def _clone_layer(layer: Any) -> Any:
    # What keras.models.clone_model does by default: a fresh layer from the
    # config; weights are copied model-wide afterwards.
    return layer.__class__.from_config(layer.get_config())


def is_input_layer(layer: Any) -> bool:
    return isinstance(layer, keras.layers.InputLayer)


def _inbound_histories(layer_config: dict) -> list[list[str]]:
    """Per inbound node, the names of the layers feeding it (config format)."""
    nodes = layer_config.get("inbound_nodes") or []
    result = []
    for node in nodes:
        names: list[str] = []
        if IS_TF_KERAS:
            # tf_keras 2.x: node = [[layer_name, node_index, tensor_index,
            # kwargs], ...]
            for entry in node:
                names.append(entry[0])
        else:
            _collect_histories(node, names)
        result.append(names)
    return result


def _collect_histories(obj: Any, names: list[str]) -> None:
    # Keras 3 config: tensors are {"class_name": "__keras_tensor__",
    # "config": {..., "keras_history": [name, node_index, tensor_index]}}.
    if isinstance(obj, dict):
        history = obj.get("config", {}) if obj.get("class_name") else None
        if isinstance(history, dict) and "keras_history" in history:
            names.append(history["keras_history"][0])
            return
        for value in obj.values():
            _collect_histories(value, names)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            _collect_histories(value, names)


def _chain_layers(model: Any) -> list | None:
    """The model's non-input layers in order if it is a plain chain."""
    if isinstance(model, keras.Sequential):
        return [layer for layer in model.layers if not is_input_layer(layer)]
    if len(model.inputs) != 1 or len(model.outputs) != 1:
        return None
    config = model.get_config()
    previous = None
    ordered = []
    by_name = {layer.name: layer for layer in model.layers}
    for layer_config in config["layers"]:
        name = layer_config["config"]["name"]
        histories = _inbound_histories(layer_config)
        if previous is None:
            if histories:  # first layer must be the input
                return None
        elif histories != [[previous]]:
            return None
        if previous is not None:
            ordered.append(by_name[name])
        previous = name
    output_names = [layer[0] for layer in _output_layer_names(config)]
    if output_names != [previous]:
        return None
    return ordered


def _output_layer_names(config: dict) -> list:
    outputs = config["output_layers"]
    if outputs and isinstance(outputs[0], str):  # a single [name, i, j]
        return [outputs]
    return outputs


def _rebuild_chain(model: Any, new_layers: list, name: str) -> Any:
    """A model of the same kind as `model` running `new_layers` in order."""
    if isinstance(model, keras.Sequential):
        input_shape = None
        if model.inputs:
            input_shape = tuple(model.inputs[0].shape[1:])
        stack = []
        if input_shape is not None:
            stack.append(
                keras.Input(
                    shape=input_shape,
                    dtype=model.inputs[0].dtype,
                    name=model.layers[0].name
                    if model.layers and is_input_layer(model.layers[0])
                    else None,
                )
            )
        return keras.Sequential(stack + new_layers, name=name)
    source = model.inputs[0]
    input_name = next(
        (layer.name for layer in model.layers if is_input_layer(layer)), None
    )
    inputs = keras.Input(
        shape=tuple(source.shape[1:]), dtype=source.dtype, name=input_name
    )
    outputs = inputs
    for layer in new_layers:
        outputs = layer(outputs)
    return keras.Model(inputs, outputs, name=name)


def _is_container(layer: Any) -> bool:
    """A `Sequential` or functional model: its weights are its layers'."""
    if isinstance(layer, keras.Sequential):
        return True
    return any(k.__name__ == "Functional" for k in type(layer).__mro__)


def _weight_units(layer: Any) -> list:
    """The layers that own weights, in order, seen through the wrappers and
    containers that `apply_recompute` / `strip_recompute` add or remove.

    Carrying weights unit by unit (not over `model.weights` as a flat list)
    keeps them right when a rebuild changes how a container orders its
    weights: a tf_keras wrapper lists every trainable weight of its block
    before the non-trainable ones, the unwrapped block lists them layer by
    layer.
    """
    if isinstance(layer, RecomputeGrad):
        return _weight_units(layer.layer)
    if _is_container(layer):
        units = []
        for sub in layer.layers:
            if not is_input_layer(sub):
                units.extend(_weight_units(sub))
        return units
    return [layer] if layer.weights else []


def _carry_weights(source: Any, target: Any) -> None:
    if not source.built:
        return
    sources, targets = _weight_units(source), _weight_units(target)
    if len(sources) != len(targets):
        raise ValueError(  # pragma: no cover - a bug, not user input
            f"Rebuilding model {source.name!r} changed its layers "
            f"({len(sources)} layers with weights became {len(targets)}); "
            "cannot carry the weights over."
        )
    for old, new in zip(sources, targets, strict=True):
        # `weights`, not `get_weights()`: TFMOT's pruning wrapper leaves its
        # mask, threshold and step out of `get_weights()`.
        weights = [np.asarray(w.numpy()) for w in old.weights]
        shapes = [tuple(w.shape) for w in new.weights]
        if type(old) is not type(new) or shapes != [w.shape for w in weights]:
            raise ValueError(  # pragma: no cover - a bug, not user input
                f"Rebuilding model {source.name!r} changed layer "
                f"{old.name!r} ({type(old).__name__}, weight shapes "
                f"{[w.shape for w in weights]}) into {new.name!r} "
                f"({type(new).__name__}, {shapes}); cannot carry the "
                "weights over."
            )
        for variable, value in zip(new.weights, weights, strict=True):
            variable.assign(value)


def rebuild_per_layer(model: Any, chosen: Callable[[Any], bool]) -> Any:
    """A clone of `model` with each chosen layer wrapped on its own."""

    def clone_function(layer: Any) -> Any:
        new = _clone_layer(layer)
        if not chosen(layer):
            return new
        return RecomputeGrad(new, name=f"recompute_{layer.name}")

    new_model = keras.models.clone_model(model, clone_function=clone_function)
    _carry_weights(model, new_model)
    return new_model


def rebuild_sqrt(model: Any, chosen: Callable[[Any], bool]) -> Any:
    """A clone of the chain `model` with chosen layers in sqrt(n) segments."""
    chain = _chain_layers(model)
    if chain is None:
        raise ValueError(
            "policy='sqrt' needs a sequential stack: a Sequential model or a "
            "functional model with one input, one output and each layer fed "
            f"by the previous one. Model {model.name!r} is not; choose its "
            "blocks with `layers=` and policy='per_layer', or pass "
            "in_place=True (segments of chained layers, side inputs "
            "allowed). Received: policy='sqrt'"
        )
    count = sum(1 for layer in chain if chosen(layer))
    size = max(1, math.ceil(math.sqrt(count)))
    new_layers: list = []
    run: list = []
    segment_index = [0]

    def flush() -> None:
        if not run:
            return
        clones = [_clone_layer(layer) for layer in run]
        if len(clones) == 1:
            new_layers.append(
                RecomputeGrad(clones[0], name=f"recompute_{clones[0].name}")
            )
        else:
            name = f"{SEGMENT_PREFIX}_{segment_index[0]}"
            segment = keras.Sequential(clones, name=name)
            new_layers.append(RecomputeGrad(segment, name=f"{name}_remat"))
        segment_index[0] += 1
        run.clear()

    for layer in chain:
        if chosen(layer):
            run.append(layer)
            if len(run) == size:
                flush()
        else:
            flush()
            new_layers.append(_clone_layer(layer))
    flush()
    new_model = _rebuild_chain(model, new_layers, model.name)
    _carry_weights(model, new_model)
    return new_model


def rebuild_stripped(model: Any) -> Any:
    """A clone of `model` with every `RecomputeGrad` unwrapped."""
    chain = _chain_layers(model)
    if chain is not None:
        new_layers = []
        for layer in chain:
            if not isinstance(layer, RecomputeGrad):
                new_layers.append(_clone_layer(layer))
                continue
            inner = layer.layer
            if isinstance(inner, keras.Sequential) and inner.name.startswith(
                SEGMENT_PREFIX
            ):
                new_layers.extend(
                    _clone_layer(sub)
                    for sub in inner.layers
                    if not is_input_layer(sub)
                )
            else:
                new_layers.append(_clone_layer(inner))
        new_model = _rebuild_chain(model, new_layers, model.name)
    else:

        def clone_function(layer: Any) -> Any:
            if isinstance(layer, RecomputeGrad):
                return _clone_layer(layer.layer)
            return _clone_layer(layer)

        new_model = keras.models.clone_model(
            model, clone_function=clone_function
        )
    _carry_weights(model, new_model)
    return new_model

"""`apply_recompute` / `strip_recompute`: wrap chosen layers of a model.

In the manner of TFMOT's `prune_low_magnitude` / `strip_pruning`: the model
is rebuilt (never modified in place) with the chosen layers wrapped in
`RecomputeGrad`, weights carried over; `strip_recompute` is the inverse.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, Union

import numpy as np

from keras_mgpu._flavour import IS_TF_KERAS, check_flavour, keras
from keras_mgpu._validation import check_choice
from keras_mgpu.layers.recompute_grad import RecomputeGrad

LayerSelector = Union[
    None,
    str,
    type,
    Callable[[Any], bool],
    Iterable[Union[str, type, Callable[[Any], bool]]],
]

POLICIES = ("per_layer", "sqrt")
SEGMENT_PREFIX = "recompute_segment"


def _is_functional(model: Any) -> bool:
    """True for a functional (graph) model, False for a subclassed one.

    Keras 3.15 does not export its `Functional` class; tf_keras 2.x marks
    graph networks with `_is_graph_network`. Both are private.
    """
    if IS_TF_KERAS:
        return bool(getattr(model, "_is_graph_network", False))
    from keras.src.models.functional import Functional

    return isinstance(model, Functional)


def _check_model(model: Any, function: str) -> None:
    check_flavour(model, "model")
    if not isinstance(model, keras.Model):
        raise TypeError(
            f"`{function}` expects a Sequential or functional keras.Model "
            "as argument `model`. Received: "
            f"model={model!r} (of type {type(model).__name__})"
        )
    if not isinstance(model, keras.Sequential) and not _is_functional(model):
        raise ValueError(
            f"`{function}` cannot rebuild a subclassed model: its layers "
            "are wired in Python code, not in a graph it can clone. Wrap the "
            "blocks yourself with `keras_mgpu.RecomputeGrad(block)` inside "
            "the model. Received: "
            f"model={model.name!r} (of type {type(model).__name__})"
        )


def _clone_layer(layer: Any) -> Any:
    # What keras.models.clone_model does by default: a fresh layer from the
    # config; weights are copied model-wide afterwards.
    return layer.__class__.from_config(layer.get_config())


def _matcher(layers: LayerSelector, model: Any) -> Callable[[Any], bool]:
    """Turn the `layers` argument into a predicate over the model's layers."""
    if layers is None:
        return lambda layer: True
    if isinstance(layers, (str, type)) or (
        callable(layers) and not isinstance(layers, Iterable)
    ):
        items = [layers]
    elif isinstance(layers, Iterable):
        items = list(layers)
    else:
        raise TypeError(
            "Argument `layers` must be None, a layer name, a layer class, a "
            "predicate `fn(layer) -> bool`, or a list of those. Received: "
            f"layers={layers!r} (of type {type(layers).__name__})"
        )
    names, classes, predicates = set(), [], []
    for item in items:
        if isinstance(item, str):
            names.add(item)
        elif isinstance(item, type) and issubclass(item, keras.layers.Layer):
            classes.append(item)
        elif callable(item) and not isinstance(item, type):
            predicates.append(item)
        else:
            raise TypeError(
                "Argument `layers` must hold layer names, Keras layer "
                "classes or predicates `fn(layer) -> bool`. Received: "
                f"layers={layers!r} with item {item!r}"
            )
    known = {layer.name for layer in model.layers}
    unknown = sorted(names - known)
    if unknown:
        raise ValueError(
            f"Argument `layers` names layers that model {model.name!r} does "
            f"not have: {unknown}. Its layers are: {sorted(known)}. "
            f"Received: layers={layers!r}"
        )

    def match(layer: Any) -> bool:
        return (
            layer.name in names
            or any(isinstance(layer, c) for c in classes)
            or any(bool(p(layer)) for p in predicates)
        )

    return match


def _is_input_layer(layer: Any) -> bool:
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
        return [layer for layer in model.layers if not _is_input_layer(layer)]
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
                    if model.layers and _is_input_layer(model.layers[0])
                    else None,
                )
            )
        return keras.Sequential(stack + new_layers, name=name)
    source = model.inputs[0]
    input_name = next(
        (layer.name for layer in model.layers if _is_input_layer(layer)), None
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
            if not _is_input_layer(sub):
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


def apply_recompute(
    model: Any,
    layers: LayerSelector = None,
    *,
    policy: str = "per_layer",
) -> Any:
    """Return a clone of `model` with chosen layers wrapped in `RecomputeGrad`.

    The model is rebuilt (`keras.models.clone_model` for `"per_layer"`), its
    weights are carried over, and the original is left untouched. Compile
    the result before training (optimizer state is not carried). Layers that
    are already `RecomputeGrad` wrappers are kept as they are.

    Policies:
    - `"per_layer"`: each chosen layer (a block: a layer, a `Sequential` or
      functional sub-model) is wrapped on its own. Saves the activations
      inside each block; the blocks' outputs are still stored.
    - `"sqrt"`: for a sequential stack (a `Sequential` model, or a
      functional model whose layers form a single chain) of n chosen blocks,
      consecutive chosen blocks are grouped into segments of
      `ceil(sqrt(n))` and each segment is wrapped as one `Sequential`
      named `recompute_segment_<k>`. Only segment boundaries are stored in
      the forward pass and one segment is recomputed at a time: O(sqrt(n))
      activation memory for one extra forward pass (Chen et al., 2016).

    Args:
        model: a `Sequential` or functional `keras.Model`. Subclassed models
            are rejected (wrap their blocks with `RecomputeGrad` directly).
        layers: which layers to wrap (default None: every layer but the
            inputs). A layer name, a layer class (matched with
            `isinstance`), a predicate `fn(layer) -> bool`, or a list mixing
            those (a layer is chosen when any item matches).
        policy: str, `"per_layer"` (default) or `"sqrt"`.

    Returns:
        A new model of the same kind.

    Example:

    ```python
    blocks = [keras.layers.Dense(64, activation="relu") for _ in range(16)]
    model = keras.Sequential([keras.Input((64,)), *blocks])
    remat = keras_mgpu.apply_recompute(model, policy="sqrt")  # 4 segments
    remat.compile("adam", "mse")
    plain = keras_mgpu.strip_recompute(remat)
    ```
    """
    _check_model(model, "apply_recompute")
    policy = check_choice(policy, "policy", POLICIES)
    match = _matcher(layers, model)

    def chosen(layer: Any) -> bool:
        return (
            not _is_input_layer(layer)
            and not isinstance(layer, RecomputeGrad)
            and match(layer)
        )

    if not any(chosen(layer) for layer in model.layers):
        raise ValueError(
            f"No layer of model {model.name!r} matched argument `layers` "
            "(input layers and layers already wrapped in RecomputeGrad are "
            f"never chosen). Received: layers={layers!r}"
        )

    if policy == "per_layer":

        def clone_function(layer: Any) -> Any:
            new = _clone_layer(layer)
            if not chosen(layer):
                return new
            return RecomputeGrad(new, name=f"recompute_{layer.name}")

        new_model = keras.models.clone_model(
            model, clone_function=clone_function
        )
        _carry_weights(model, new_model)
        return new_model

    chain = _chain_layers(model)
    if chain is None:
        raise ValueError(
            "policy='sqrt' needs a sequential stack: a Sequential model or a "
            "functional model with one input, one output and each layer fed "
            f"by the previous one. Model {model.name!r} is not; choose its "
            "blocks with `layers=` and policy='per_layer'. Received: "
            "policy='sqrt'"
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


def strip_recompute(model: Any) -> Any:
    """Return a clone of `model` with every `RecomputeGrad` unwrapped.

    The inverse of `apply_recompute`: wrapped layers are replaced by (clones
    of) the layers they wrap, segments made by `policy="sqrt"` are inlined
    back into the stack, weights are carried over. Compile the result before
    training.

    Args:
        model: a `Sequential` or functional `keras.Model`.

    Returns:
        A new model of the same kind, without `RecomputeGrad` wrappers.

    Example:

    ```python
    plain = keras_mgpu.strip_recompute(remat_model)
    ```
    """
    _check_model(model, "strip_recompute")
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
                    if not _is_input_layer(sub)
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

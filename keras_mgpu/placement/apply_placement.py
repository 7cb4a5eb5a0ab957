"""`apply_placement` / `strip_placement`: split one network across devices.

In the manner of `apply_recompute`: the model is rebuilt (never modified
in place) with each layer in a `PlacedLayer` on its stage's device, its
variables created there and the weights copied over; `strip_placement`
is the inverse.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Union

from keras_mgpu._flavour import keras_of
from keras_mgpu._validation import check_int
from keras_mgpu.layers.apply_recompute import carry_recompute
from keras_mgpu.layers.recompute_in_place import (
    graph_of,
    is_switched_per_layer,
    recompute_layer_in_place,
)
from keras_mgpu.normalization._warn import (
    carry_batchnorm_choices,
    warn_if_unremedied,
)
from keras_mgpu.placement import _graph
from keras_mgpu.placement.devices import check_strategy, variables_on
from keras_mgpu.placement.partition import assign_devices
from keras_mgpu.placement.pipeline import MicroBatchSplit, pipelined
from keras_mgpu.placement.placed_layer import PlacedLayer, PlacedOperation
from keras_mgpu.placement.placed_model import PlacedModel

# Placement is Keras 3 only, whatever TF_USE_LEGACY_KERAS says.
keras = keras_of("keras3")

Policy = Union[str, Mapping[Any, Any], Sequence[Union[int, str]]]


def _fresh_copy(layer: Any) -> Any:
    # What keras.models.clone_model does by default: a new layer from the
    # config; the variables are copied afterwards.
    return layer.__class__.from_config(layer.get_config())


def _copy_variables(source: Any, target: Any) -> None:
    """Assign every variable of `source` (weights, statistics, seed
    states) to the same-shaped variable of `target`, in order."""
    old, new = source.variables, target.variables
    shapes_old = [(tuple(v.shape), str(v.dtype)) for v in old]
    shapes_new = [(tuple(v.shape), str(v.dtype)) for v in new]
    if shapes_old != shapes_new:
        raise ValueError(  # pragma: no cover - a bug, not user input
            f"Rebuilding layer {source.name!r} changed its variables "
            f"({shapes_old} became {shapes_new}); cannot copy them."
        )
    for a, b in zip(old, new, strict=True):
        b.assign(a.value)


def _placed_layers(model: Any) -> list:
    """Every PlacedLayer of a placed model (through a pipelined graph)."""
    found = []
    for layer in model.layers:
        if isinstance(layer, PlacedLayer):
            found.append(layer)
        elif isinstance(layer, keras.Model):
            found.extend(_placed_layers(layer))
    return found


def _stage_graph(model: Any) -> Any:
    """The functional model of PlacedLayers (inside a pipelined model)."""
    for layer in model.layers:
        if isinstance(layer, keras.Model) and _placed_layers(layer):
            return layer
    return model


def micro_batches_of(model: Any) -> int:
    """Micro-batches per step of a placed model (1 when not pipelined)."""
    for layer in model.layers:
        if isinstance(layer, MicroBatchSplit):
            return layer.micro_batches
    return 1


def _place_layers(source: Any, device_of: dict[str, str]) -> Any:
    """A functional clone of `source` with each layer in a PlacedLayer."""

    current = [next(iter(device_of.values()))]

    def clone_function(layer: Any) -> Any:
        if _graph.is_input_layer(layer):
            return _fresh_copy(layer)
        # A bare operation (`x + y` in a functional graph) runs where the
        # layer cloned just before it (graph order) runs.
        device = device_of.get(layer.name, current[0])
        current[0] = device
        if not isinstance(layer, keras.layers.Layer):
            return PlacedOperation(_fresh_copy(layer), device)
        with variables_on(device):
            return PlacedLayer(_fresh_copy(layer), device)

    functional = _graph.as_functional(source)
    clone = _graph.rebuild(functional, clone_function)
    for layer in _graph.units(functional):
        _copy_variables(layer, clone.get_layer(layer.name).layer)
    return clone


def _check_dense_inputs(model: Any, micro_batches: int) -> None:
    """Micro-batches are cut with `tf.split`, which needs dense tensors."""
    for tensor in keras.tree.flatten(model.input):
        if getattr(tensor, "sparse", False) or getattr(tensor, "ragged", False):
            raise ValueError(
                "Argument `micro_batches` needs dense inputs: model input "
                f"{_graph.producer(tensor).name!r} is sparse or ragged, "
                "which cannot be cut into micro-batches. Use "
                "micro_batches=None, or densify the input. Received: "
                f"micro_batches={micro_batches}"
            )


def apply_placement(
    model: Any,
    devices: Sequence[Any] | None = None,
    policy: Policy = "balanced",
    *,
    micro_batches: int | None = None,
) -> PlacedModel:
    """Return a copy of `model` split into stages across `devices`.

    Each layer (a nested model counts as one) is wrapped in a
    `PlacedLayer` on its stage's device: its variables are created there,
    its forward and backward passes run there, and activations cross
    devices only where a layer on one device feeds a layer on another.
    The weights are copied; the original is left untouched. Compile the
    result and train it with `model.fit` under the default strategy or
    `OneDeviceStrategy`.

    Policies:
    - `"balanced"` (default): contiguous stages in graph order, one per
      device, minimising the largest stage's parameter bytes (exactly);
      among equally good cuts, the one moving the fewest activation bytes.
    - `{layer name or layer class: device}`: those layers go to that
      device; every other layer stays on the device of the layer before it
      (the first ones on the first mapped device).
    - a list of cut points (layer positions in graph order, or layer
      names): stage k starts at cut point k-1; one fewer than the devices.

    Pipelining (`micro_batches=M`): each batch is cut into M micro-batches
    inside the step and the stages work on different micro-batches at the
    same time (GPipe). The loss sees the whole batch, so gradients equal
    the un-pipelined model's for layers that treat examples independently.
    Random layers draw per micro-batch, and BatchNormalization normalises
    and updates its statistics per micro-batch (M updates per step), as
    under gradient accumulation (with M > 1 and no choice made in
    `keras_mgpu.normalization`, one `BatchNormMicroBatchWarning` says so;
    the placed copy keeps the choices made on `model`). Training batches
    need at least M examples.

    Recompute (GPipe's re-materialisation) composes in either order.
    Layers recomputed in place (`apply_recompute(..., in_place=True)`)
    stay recomputed: a switched layer is switched in its placed copy and
    recomputed on its device; a segment of the top-level graph (`group_by`,
    `policy="sqrt"` or `"min_memory"`) becomes a segment of the placed
    layers, recomputed as one unit (once per micro-batch), each part on its
    device. A placed
    model can be recomputed in place afterwards too (`layers=None` with
    `group_by` finds the layers inside a pipelined model's stages). A
    model rebuilt by `apply_recompute` is placed with each `RecomputeGrad`
    block whole.

    Args:
        model: a built `Sequential` or functional Keras 3 model (not
            subclassed, not already placed).
        devices: device names (`"/gpu:0"`, `"cpu:1"`, ...) or
            `tf.config.LogicalDevice`s, one stage each, in order. Default:
            every GPU, else every logical CPU device. With a mapping
            policy, the devices the mapping may use.
        policy: `"balanced"`, a mapping or a list of cut points (above).
        micro_batches: int >= 1 or None (default, no pipelining).

    Returns:
        A `PlacedModel` (functional) with the same inputs, outputs and
        output names; `strip_placement` gives the plain model back.

    Raises:
        ValueError: an unknown or repeated device, more devices than
            layers, a mapping naming no layer, bad cut points, a subclassed
            or unbuilt model, or a strategy in scope that replicates
            (MirroredStrategy, multi-worker, ...).

    Example:

    ```python
    model = keras.Sequential([keras.Input((784,))] + [
        keras.layers.Dense(2048, activation="relu") for _ in range(8)
    ] + [keras.layers.Dense(10)])
    placed = keras_mgpu.apply_placement(
        model, ["/gpu:0", "/gpu:1"], micro_batches=4
    )
    placed.compile("adam", "mse")
    keras_mgpu.placement_report(placed)
    placed.fit(x, y, batch_size=256)
    plain = keras_mgpu.strip_placement(placed)
    ```
    """
    _graph.check_model(model, "apply_placement")
    if _placed_layers(model):
        raise ValueError(
            "Argument `model` is already placed; call "
            "`keras_mgpu.strip_placement(model)` first to place it anew. "
            f"Received: model={model.name!r}"
        )
    micro_batches = check_int(
        micro_batches, "micro_batches", minimum=1, allow_none=True
    )
    check_strategy("apply_placement")
    functional = _graph.as_functional(model)
    if micro_batches and micro_batches > 1:
        _check_dense_inputs(functional, micro_batches)
        # BatchNormalization per micro-batch, with no choice made: once.
        warn_if_unremedied(model, micro_batches=micro_batches)
    placeable = _graph.units(functional)
    device_list = assign_devices(
        model,
        placeable,
        devices,
        policy,
        weights=[_graph.param_bytes(layer) for layer in placeable],
        costs=_graph.cut_costs(functional, placeable),
    )
    device_of = {layer.name: d for layer, d in zip(placeable, device_list)}
    stages = _place_layers(functional, device_of)
    if not micro_batches or micro_batches == 1:
        placed = PlacedModel(stages.input, stages.output, name=model.name)
    else:
        stages = keras.Model(
            stages.input, stages.output, name=f"{model.name}_stages"
        )
        last = {
            name: device_of.get(name, device_list[-1])
            for name in stages.output_names
        }
        inputs, outputs = pipelined(stages, micro_batches, device_list[0], last)
        placed = PlacedModel(inputs, outputs, name=model.name)
    _carry_recompute(model, placeable, placed, "apply_placement")
    carry_batchnorm_choices(model, placed)
    return placed


def _carry_recompute(
    source: Any, layers: list, placed: Any, function: str
) -> None:
    """Recompute in `placed` what `apply_recompute(..., in_place=True)`
    switched in `source` (rebuilding from configs drops it): each layer
    switched anywhere inside a placed layer is switched in its copy, which
    its `PlacedLayer` calls (the recomputation runs on the device); each
    recomputed segment of the top-level graph becomes a segment of the
    `PlacedLayer`s of its layers, run as one recomputed unit (with
    `micro_batches`, once per micro-batch)."""
    stage_graph = _stage_graph(placed)
    pairs = [
        (layer, stage_graph.get_layer(layer.name).layer)
        for layer in layers
        if isinstance(layer, keras.layers.Layer)
    ]
    carry_recompute(pairs, (graph_of(source), stage_graph), function)


def strip_placement(model: Any) -> Any:
    """Return the plain functional model inside a placed one.

    The inverse of `apply_placement`: every `PlacedLayer` is replaced by a
    fresh copy of the layer it wraps (its variables on the default device)
    and the weights are copied, so the result computes what the placed
    model computes (without micro-batches). A `Sequential` that was placed
    comes back as the equivalent functional model. Layers recomputed in
    place stay recomputed (see `apply_placement`).

    Args:
        model: a model returned by `apply_placement` (or loaded from its
            `.keras` file).

    Returns:
        A functional `keras.Model` with the same name, inputs and outputs.

    Example:

    ```python
    plain = keras_mgpu.strip_placement(placed)
    plain.save("model.keras")   # loads anywhere, one device
    ```
    """
    _graph.check_model(model, "strip_placement")
    if not _placed_layers(model):
        raise ValueError(
            "Argument `model` has no placed layers: it is not a model from "
            f"`apply_placement`. Received: model={model.name!r}"
        )
    stages = _stage_graph(model)

    def clone_function(layer: Any) -> Any:
        if isinstance(layer, PlacedLayer):
            return _fresh_copy(layer.layer)
        if isinstance(layer, PlacedOperation):
            return _fresh_copy(layer.operation)
        return _fresh_copy(layer)

    clone = _graph.rebuild(_graph.as_functional(stages), clone_function)
    placed_layers = _placed_layers(stages)
    for layer in placed_layers:
        _copy_variables(layer.layer, clone.get_layer(layer.name))
    plain = keras.Model(clone.input, clone.output, name=model.name)
    # Recompute switches come back with the plain layers: a switched
    # PlacedLayer switches its plain copy, switches inside it are carried
    # to the copy's sublayers, segments of PlacedLayers become segments of
    # the plain layers.
    pairs = []
    for layer in placed_layers:
        copy = plain.get_layer(layer.name)
        if is_switched_per_layer(layer):
            recompute_layer_in_place(copy)
        else:
            pairs.append((layer.layer, copy))
    carry_recompute(pairs, (stages, plain), "strip_placement")
    carry_batchnorm_choices(model, plain)
    return plain


__all__ = [
    "apply_placement",
    "micro_batches_of",
    "strip_placement",
]

"""`plan_layout_map`: a `keras.distribution.LayoutMap` planned from a built
model: Megatron-style column/row splits along the model axis, balanced over
the batch axis, small weights replicated."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from keras_mgpu._validation import check_int
from keras_mgpu.sharding import _dataflow, _weights

POLICIES = ("balanced", "model")
DEFAULT_MIN_SHARD_BYTES = 4096


@dataclass
class PlanNotes:
    """What `plan_layout_map` decided and why (kept on the map it returns,
    read by `check_layout_map`)."""

    dataflow: str  # "traced" or "variable order"
    roles: dict[str, str] = field(default_factory=dict)
    reasons: dict[str, str] = field(default_factory=dict)
    fallbacks: dict[str, str] = field(default_factory=dict)
    overridden: dict[str, str] = field(default_factory=dict)
    # The axis the batch is split along (`batch_axis`): it cannot also split
    # an activation's features (check_layout_map's activation layouts).
    batch_axis: str | None = None


def require_jax(component: str) -> None:
    from keras_mgpu.backend import require_backend

    require_backend(
        component,
        ("jax",),
        instead=(
            "keras_mgpu.apply_placement (layer-wise model parallelism "
            "under tf.distribute, with placement_report)"
        ),
    )


def check_mesh(mesh: Any, argument: str = "mesh") -> Any:
    import keras

    if not isinstance(mesh, keras.distribution.DeviceMesh):
        raise TypeError(
            f"Argument `{argument}` must be a keras.distribution.DeviceMesh. "
            f"Received: {argument}={mesh!r} (of type {type(mesh).__name__})"
        )
    return mesh


def axis_size(mesh: Any, name: str | None) -> int:
    if name is None or name not in mesh.axis_names:
        return 1
    return int(mesh.shape[list(mesh.axis_names).index(name)])


def check_model(model: Any, component: str) -> None:
    import keras

    if not isinstance(model, keras.layers.Layer):
        raise TypeError(
            f"{component}: argument `model` must be a built Keras model or "
            f"layer. Received: model of type {type(model).__name__}"
        )
    if not model.built or not model.weights:
        raise ValueError(
            f"{component}: argument `model` must be built and have weights "
            f"(call it on data or `model.build(shape)` first). Received: "
            f"model={model.name!r} (built={model.built}, "
            f"{len(model.weights)} weights)"
        )


def _check_axes(mesh: Any, model_axis: Any, batch_axis: Any) -> None:
    names = list(mesh.axis_names)
    if not isinstance(model_axis, str) or model_axis not in names:
        raise ValueError(
            f"Argument `model_axis` must name an axis of the mesh "
            f"{names}. Received: model_axis={model_axis!r}"
        )
    if batch_axis is not None and (
        not isinstance(batch_axis, str) or batch_axis not in names
    ):
        raise ValueError(
            f"Argument `batch_axis` must name an axis of the mesh {names} or "
            f"be None. Received: batch_axis={batch_axis!r}"
        )
    if batch_axis == model_axis:
        raise ValueError(
            "Arguments `model_axis` and `batch_axis` must differ. Received: "
            f"model_axis={model_axis!r}, batch_axis={batch_axis!r}"
        )


def _check_overrides(overrides: Any, infos: list) -> dict[str, Any]:
    if overrides is None:
        return {}
    if not isinstance(overrides, Mapping):
        raise TypeError(
            "Argument `overrides` must be a mapping {regex pattern: layout "
            "(tuple of axis names / None, or TensorLayout)} or None. "
            f"Received: overrides of type {type(overrides).__name__}"
        )
    for pattern in overrides:
        try:
            regex = re.compile(pattern)
        except (re.error, TypeError) as exc:
            raise ValueError(
                f"Argument `overrides` holds a pattern that is not a regular "
                f"expression: {pattern!r} ({exc})"
            ) from None
        if not any(regex.fullmatch(info.path) for info in infos):
            raise ValueError(
                f"Argument `overrides` holds pattern {pattern!r}, which "
                "matches no variable path of the model (paths are matched "
                "whole, as keras.distribution.LayoutMap does; e.g. "
                f"{infos[0].path!r})"
            )
    return dict(overrides)


def _default_inputs(model: Any) -> Any:
    try:
        return model.input
    except (AttributeError, ValueError):
        pass
    # A `Sequential` built from an `Input` has never been called, so its
    # `input` raises (Keras 3.15); its `inputs` are known.
    try:
        inputs = model.inputs
    except (AttributeError, ValueError):
        return None
    if not inputs:
        return None
    return inputs[0] if len(inputs) == 1 else list(inputs)


def _roles_by_order(infos: list) -> dict[int, str]:
    """Without a data flow: kernels alternate column/row in variable order;
    a kernel contracting several dimensions (an attention output) is row."""
    roles = {}
    previous = "row"
    for info in infos:
        if info.kind != "kernel":
            continue
        if len(info.contracted) > 1:
            role = "row"
        else:
            role = "column" if previous == "row" else "row"
        roles[info.index] = role
        previous = role
    return roles


def _first_divisible(
    shape: tuple, dims: list[int], size: int, taken: set[int]
) -> int | None:
    for dim in dims:
        if dim not in taken and shape[dim] % size == 0 and shape[dim] >= size:
            return dim
    return None


def plan_layout_map(
    model: Any,
    mesh: Any,
    *,
    model_axis: str = "model",
    batch_axis: str | None = "batch",
    policy: str = "balanced",
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
    overrides: Mapping[str, Any] | None = None,
    inputs: Any = None,
) -> Any:
    """Plan a `keras.distribution.LayoutMap` that shards `model` over `mesh`.

    Every kernel of `Dense`, `EinsumDense` (attention projections included),
    convolutions and keras-hub's reverse embeddings is split along
    `model_axis`, alternating along the data flow as Megatron-LM does: a
    contraction whose input is whole is split by columns (an output
    dimension: attention q/k/v by heads, FFN in), one fed by a column split
    is split by rows (a contracted dimension: attention output, FFN out), so
    the pair needs one all-reduce and no re-layout between. The data flow is
    read by tracing one forward pass (`jax.make_jaxpr`, shapes only); a
    model that cannot be traced (a subclassed model never called on
    symbolic inputs, with no `inputs` given) alternates in variable order.
    Embedding tables are split by vocabulary, the bias of a column-split
    layer follows its kernel, and rank-1 weights (norm scales, row-split
    biases) and weights under `min_shard_bytes` stay replicated. When the
    preferred dimension is not divisible by the axis size the next
    dimension that is gets the axis (a single key/value head: the head
    dimension); when none is, the weight stays replicated and
    `check_layout_map`'s report lists it under fallbacks.

    `policy="balanced"` (default) also splits another dimension of each
    sharded weight along `batch_axis` (fully sharded data parallelism: every
    device holds 1/N of the weight, XLA gathers it for the step), as
    keras-hub's own `get_layout_map` does; `policy="model"` splits along
    the model axis only (weights replicated across the batch axis).

    The map has one exact key per sharded variable path (the planner's
    choices) plus your `overrides` patterns unchanged; a variable an
    override matches gets no key of the planner's, so yours wins. Paths
    are those of `model`: build the model you will train with the same
    layer names (`clear_session()` first, or named layers) inside
    `keras.distribution.ModelParallel(layout_map=...).scope()`.

    JAX only: on TensorFlow it raises `BackendNotSupportedError` (use
    `keras_mgpu.apply_placement` there).

    Args:
        model: a built Keras model (functional, Sequential, subclassed or a
            keras-hub backbone) or layer.
        mesh: `keras.distribution.DeviceMesh`.
        model_axis: str, the mesh axis weights are split along. Defaults to
            "model".
        batch_axis: str or None, the mesh axis the batch is split along
            (and, with `policy="balanced"`, a second weight dimension).
            Defaults to "batch"; None or an axis of size 1: no second split.
        policy: "balanced" (default) or "model" (above).
        min_shard_bytes: int >= 0, weights smaller than this stay
            replicated. Defaults to 4096.
        overrides: `{regex pattern: layout}` (a tuple of axis names / None,
            or a `TensorLayout`) that win over the plan. Each pattern must
            match a variable path.
        inputs: example inputs (arrays or `jax.ShapeDtypeStruct`s) in the
            structure the model is called with, to trace the data flow of a
            model without symbolic inputs. Default: `model.input`
            (`model.inputs` for a `Sequential` started with an `Input`).

    Returns:
        A `keras.distribution.LayoutMap` on `mesh`.

    Raises:
        TypeError: `mesh` is not a `DeviceMesh`, `overrides` not a mapping.
        ValueError: an axis not in the mesh, `model_axis == batch_axis`, an
            unknown policy, an unbuilt model, an override pattern that is
            not a regex or matches no variable.

    Example:

    ```python
    import keras
    import keras_mgpu.sharding
    mesh = keras.distribution.DeviceMesh(
        (2, 2), ("batch", "model"), keras.distribution.list_devices()[:4])
    def build():
        inputs = keras.Input((64,))
        x = keras.layers.Dense(256, activation="relu", name="up")(inputs)
        x = keras.layers.Dense(64, name="down")(x)
        return keras.Model(inputs, x)
    layout_map = keras_mgpu.sharding.plan_layout_map(build(), mesh)
    layout_map["up/kernel"].axes, layout_map["down/kernel"].axes
    # ('batch', 'model'), ('model', 'batch')
    keras.backend.clear_session()
    with keras.distribution.ModelParallel(layout_map=layout_map).scope():
        model = build()  # the same paths, now sharded
    print(keras_mgpu.sharding.check_layout_map(model, layout_map))
    ```
    """
    import keras

    require_jax("plan_layout_map")
    check_mesh(mesh)
    check_model(model, "plan_layout_map")
    _check_axes(mesh, model_axis, batch_axis)
    if policy not in POLICIES:
        raise ValueError(
            f"Argument `policy` must be one of {POLICIES}. "
            f"Received: policy={policy!r}"
        )
    min_shard_bytes = check_int(min_shard_bytes, "min_shard_bytes", minimum=0)
    infos = _weights.describe(model)
    overrides = _check_overrides(overrides, infos)
    n_model = axis_size(mesh, model_axis)
    n_batch = axis_size(mesh, batch_axis) if policy == "balanced" else 1

    if inputs is None:
        inputs = _default_inputs(model)
    uses = None
    if inputs is not None:
        uses = _dataflow.trace_uses(
            model, [info.variable for info in infos], inputs
        )
    if uses is not None:
        roles = _dataflow.roles_from_uses(uses, len(infos))
        notes = PlanNotes(dataflow="traced", batch_axis=batch_axis)
    else:
        roles = _roles_by_order(infos)
        notes = PlanNotes(dataflow="variable order", batch_axis=batch_axis)

    layouts: dict[str, tuple] = {}
    by_path = {}
    for info in infos:
        by_path[info.path] = info
        matched = [p for p in overrides if re.fullmatch(p, info.path)]
        if matched:
            notes.overridden[info.path] = matched[0]
            continue
        if info.kind in ("elementwise", "bias"):
            continue  # rank-1 weights stay replicated; biases follow below
        if info.nbytes < min_shard_bytes:
            notes.reasons[info.path] = (
                f"replicated: {info.nbytes} bytes < min_shard_bytes="
                f"{min_shard_bytes}"
            )
            continue
        rank = len(info.shape)
        role = roles.get(info.index, "column")
        if info.kind == "embedding":
            preferred, others = [0], [1]
            role = "lookup"
        elif info.kind == "kernel":
            column, row = list(info.output), list(info.contracted)
            if role == "row":
                preferred, others = row, column
            else:
                role = "column"
                preferred, others = column, row
            others += [d for d in range(rank) if d not in column + row]
        else:
            role = "generic"
            preferred = sorted(range(rank), key=lambda d: -info.shape[d])
            others = []
        notes.roles[info.path] = role
        dim = _first_divisible(info.shape, preferred + others, n_model, set())
        if dim is not None and preferred and dim != preferred[0]:
            notes.reasons[info.path] = (
                f"{role}: dimension {preferred[0]} of shape {info.shape} is "
                f"not divisible by {model_axis}={n_model}; split dimension "
                f"{dim} instead"
            )
        if dim is None:
            notes.fallbacks[info.path] = (
                f"replicated: no dimension of shape {info.shape} is "
                f"divisible by {model_axis}={n_model}"
            )
            continue
        axes = [None] * rank
        axes[dim] = model_axis
        if n_batch > 1:
            rest = sorted(
                (d for d in range(rank) if d != dim),
                key=lambda d: -info.shape[d],
            )
            second = _first_divisible(info.shape, rest, n_batch, {dim})
            if second is not None:
                axes[second] = batch_axis
        layouts[info.path] = tuple(axes)

    for info in infos:  # the bias of a column split follows its kernel
        if info.kind != "bias" or info.path in notes.overridden:
            continue
        kernel_axes = layouts.get(info.kernel_path)
        if kernel_axes is None or notes.roles.get(info.kernel_path) != (
            "column"
        ):
            continue
        axes = [None] * len(info.shape)
        for i, kernel_dim in enumerate(info.kernel_dims):
            if (
                kernel_dim is not None
                and kernel_axes[kernel_dim] == model_axis
                and info.shape[i] % n_model == 0
            ):
                axes[i] = model_axis
        if model_axis in axes:
            layouts[info.path] = tuple(axes)
            notes.roles[info.path] = "bias of a column split"

    layout_map = keras.distribution.LayoutMap(mesh)
    for path, axes in layouts.items():
        layout_map[re.escape(path)] = axes
    for pattern, layout in overrides.items():
        if isinstance(layout, list):
            layout = tuple(layout)
        layout_map[pattern] = layout
    # Kept for check_layout_map's report (plain attribute on the map).
    layout_map._keras_mgpu_plan = notes
    return layout_map

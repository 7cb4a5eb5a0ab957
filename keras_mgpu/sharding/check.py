"""`check_layout_map`: does a `LayoutMap` fit a model and a mesh, and what
does each device hold under it (`LayoutReport`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from keras_mgpu._validation import check_int, check_number
from keras_mgpu.backend.keras_serialization import tensorflow_left_alone
from keras_mgpu.sharding import _weights
from keras_mgpu.sharding.plan import (
    DEFAULT_MIN_SHARD_BYTES,
    check_mesh,
    check_model,
    require_jax,
)


@dataclass
class VariableRow:
    path: str
    shape: tuple[int, ...]
    dtype: str
    axes: tuple | None  # None: replicated (no pattern)
    pattern: str | None
    bytes: int
    bytes_per_device: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "axes": None if self.axes is None else list(self.axes),
            "pattern": self.pattern,
            "bytes": self.bytes,
            "bytes_per_device": self.bytes_per_device,
        }


@dataclass
class LayoutReport:
    """What a `LayoutMap` does to a model on a mesh (`check_layout_map`).

    Attributes:
        mesh: `{axis name: size}`.
        variables: one `VariableRow` per model variable (path, shape,
            dtype, axes, the pattern that matched, bytes, bytes per device).
        matches: `{pattern: [variable paths]}` for every pattern of the map.
        unmatched_patterns: patterns matching no variable and no layer
            output (listed when `allow_unmatched=True`; an error otherwise).
        activation_patterns: patterns matching a layer output path
            (`<layer path>/output`, which Keras re-lays out after the call).
        replicated: paths of the variables with no split at all.
        fallbacks: `{path: reason}` for weights that a model-axis split
            would suit (kernels, embeddings over `min_shard_bytes`) left
            replicated along it.
        param_bytes: bytes of all variables (unsharded).
        param_bytes_per_device: bytes of variables each device holds.
        optimizer_multiplier: optimizer state in copies of the trainable
            variables (None when neither optimizer nor multiplier given).
        optimizer_bytes_per_device: bytes of optimizer state per device
            (None as above).
        measured_param_bytes_per_device: the most bytes of the model's
            variables any one device holds now (read from the arrays'
            shards; None when the variables are not laid out on the mesh's
            devices).
        measured_optimizer_bytes_per_device: the most bytes of the
            optimizer's state any one device holds now, read from its
            variables' shards (a built `optimizer` whose variables live on
            the mesh; None otherwise): below `optimizer_bytes_per_device`
            once `shard_optimizer_state` split it over the data axis.
        activations: `{layer output path: axes}` derived from the kernels'
            layouts (a column-split Dense/EinsumDense output is split along
            the model axis on its feature dimension; a kernel dimension
            split along the batch axis, as `policy="balanced"` does, splits
            no feature: the batch axis is the planner's `batch_axis`, else
            an axis named "batch", else the mesh's first axis).
        planner: the planner's notes (data flow, roles, reasons) when the
            map came from `plan_layout_map`, else None.
    """

    mesh: dict[str, int]
    variables: list[VariableRow]
    matches: dict[str, list[str]]
    unmatched_patterns: list[str]
    activation_patterns: dict[str, list[str]]
    replicated: list[str]
    fallbacks: dict[str, str]
    param_bytes: int
    param_bytes_per_device: int
    optimizer_multiplier: float | None = None
    optimizer_bytes_per_device: int | None = None
    measured_param_bytes_per_device: int | None = None
    measured_optimizer_bytes_per_device: int | None = None
    activations: dict[str, tuple] = field(default_factory=dict)
    planner: Any = None

    @property
    def sharded_fraction(self) -> float:
        """Per-device parameter bytes over the unsharded model's."""
        return self.param_bytes_per_device / max(self.param_bytes, 1)

    def to_dict(self) -> dict[str, Any]:
        planner = None
        if self.planner is not None:
            planner = {
                "dataflow": self.planner.dataflow,
                "roles": dict(self.planner.roles),
                "reasons": dict(self.planner.reasons),
                "fallbacks": dict(self.planner.fallbacks),
                "overridden": dict(self.planner.overridden),
            }
        return {
            "mesh": dict(self.mesh),
            "variables": [row.to_dict() for row in self.variables],
            "matches": {k: list(v) for k, v in self.matches.items()},
            "unmatched_patterns": list(self.unmatched_patterns),
            "activation_patterns": {
                k: list(v) for k, v in self.activation_patterns.items()
            },
            "replicated": list(self.replicated),
            "fallbacks": dict(self.fallbacks),
            "param_bytes": self.param_bytes,
            "param_bytes_per_device": self.param_bytes_per_device,
            "sharded_fraction": self.sharded_fraction,
            "optimizer_multiplier": self.optimizer_multiplier,
            "optimizer_bytes_per_device": self.optimizer_bytes_per_device,
            "measured_param_bytes_per_device": (
                self.measured_param_bytes_per_device
            ),
            "measured_optimizer_bytes_per_device": (
                self.measured_optimizer_bytes_per_device
            ),
            "activations": {
                k: [a for a in v] for k, v in self.activations.items()
            },
            "planner": planner,
        }

    def __str__(self) -> str:
        mesh = " x ".join(f"{k}={v}" for k, v in self.mesh.items())
        lines = [
            f"LayoutReport on mesh {mesh}: {len(self.variables)} variables, "
            f"{_mib(self.param_bytes)} unsharded, "
            f"{_mib(self.param_bytes_per_device)} per device "
            f"({self.sharded_fraction:.3f})",
        ]
        if self.measured_param_bytes_per_device is not None:
            lines.append(
                "  measured on the devices: "
                f"{_mib(self.measured_param_bytes_per_device)} per device"
            )
        if self.optimizer_bytes_per_device is not None:
            lines.append(
                f"  optimizer state ({self.optimizer_multiplier:g}x): "
                f"{_mib(self.optimizer_bytes_per_device)} per device"
            )
        if self.measured_optimizer_bytes_per_device is not None:
            lines.append(
                "  optimizer state measured on the devices: "
                f"{_mib(self.measured_optimizer_bytes_per_device)} per device"
            )
        width = max(len(r.path) for r in self.variables)
        lines.append(
            f"  {'variable':<{width}}  {'shape':<16} {'axes':<28} per device"
        )
        for row in self.variables:
            axes = "replicated" if row.axes is None else str(row.axes)
            lines.append(
                f"  {row.path:<{width}}  {str(row.shape):<16} {axes:<28} "
                f"{row.bytes_per_device}"
            )
        for pattern, paths in self.matches.items():
            lines.append(f"  pattern {pattern!r}: {len(paths)} variables")
        for pattern in self.unmatched_patterns:
            lines.append(f"  pattern {pattern!r}: matches nothing")
        for path, reason in self.fallbacks.items():
            lines.append(f"  fallback {path}: {reason}")
        for path, axes in self.activations.items():
            lines.append(f"  activation {path}: {axes}")
        return "\n".join(lines)

    __repr__ = __str__


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.3f} MiB"


def _layout_axes(layout: Any) -> tuple:
    return tuple(layout.axes) if hasattr(layout, "axes") else tuple(layout)


def _axis_product(mesh_sizes: dict, entry: Any) -> int:
    if entry is None:
        return 1
    names = entry if isinstance(entry, (tuple, list)) else (entry,)
    return math.prod(mesh_sizes[n] for n in names)


def _layer_output_paths(model: Any) -> list[str]:
    """`<variable's layer path>/output` for every layer owning a variable,
    and each of its parents (the paths Keras asks the distribution for)."""
    found = set()
    for variable in model.weights:
        parts = variable.path.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            found.add("/".join(parts[:i]) + "/output")
    return sorted(found)


def _measured(variables: list, mesh: Any) -> int | None:
    devices = {str(d) for d in mesh.devices.flatten()}
    per_device: dict[str, int] = {}
    for variable in variables:
        value = variable.value
        shards = getattr(value, "addressable_shards", None)
        if not shards:
            return None
        for shard in shards:
            name = str(shard.device)
            per_device[name] = per_device.get(name, 0) + int(shard.data.nbytes)
    if not per_device or set(per_device) - devices:
        return None
    if len(per_device) < len(devices):
        return None  # not laid out on the mesh (one device holds it all)
    return max(per_device.values())


def _optimizer_multiplier(
    optimizer: Any, trainable_variables: list, trainable_bytes: int
) -> float:
    """Optimizer state in copies of the trainable variables: a built
    optimizer's variables are measured; an unbuilt one is measured on a
    throwaway copy built on the model's variables (shapes only: nothing
    is allocated), so wrappers, EMA, `amsgrad` and shape-dependent state
    (Adafactor, Muon) count as they will once built."""
    if getattr(optimizer, "built", False):
        shapes = [(tuple(v.shape), str(v.dtype)) for v in optimizer.variables]
    else:
        shapes = _unbuilt_state_shapes(optimizer, trainable_variables)
    return _state_bytes(shapes) / max(trainable_bytes, 1)


def _state_bytes(shapes: list) -> int:
    # Scalars (step counters, loss scales) are not per-variable state.
    return sum(
        _weights.nbytes_of(shape, dtype) for shape, dtype in shapes if shape
    )


def _unbuilt_state_shapes(
    optimizer: Any, trainable_variables: list
) -> list[tuple[tuple[int, ...], str]]:
    """The shapes and dtypes of the variables `optimizer` would hold once
    built on `trainable_variables`, from a copy built under
    `jax.eval_shape`."""
    import jax
    import keras

    name = type(optimizer).__name__
    shapes: list[tuple[tuple[int, ...], str]] = []

    def build() -> tuple:
        # Under `eval_shape` the slots' initializers give abstract values:
        # a copy of a large model's state is never allocated. The copy is
        # made from the config (a deep copy pickles through a `.keras`
        # save); Keras serializes a nested optimizer or a schedule with
        # `serialize_keras_object`, which would import TensorFlow.
        with tensorflow_left_alone():
            copy = type(optimizer).from_config(optimizer.get_config())
        copy.build(trainable_variables)
        shapes.extend(
            (
                tuple(int(d) for d in v.shape),
                keras.backend.standardize_dtype(v.dtype),
            )
            for v in copy.variables
        )
        return ()

    try:
        jax.eval_shape(build)
    except Exception as exc:  # noqa: BLE001 - any optimizer may be passed
        raise ValueError(
            "Argument `optimizer` is an unbuilt "
            f"{name}, whose state size keras_mgpu could not measure on a "
            f"copy built on the model's variables ({type(exc).__name__}: "
            f"{exc}). Build it (optimizer.build(model.trainable_variables)) "
            "or pass `optimizer_multiplier` (its state in copies of the "
            "trainable variables)."
        ) from None
    return shapes


def check_layout_map(
    model: Any,
    layout_map: Any,
    mesh: Any = None,
    *,
    optimizer: Any = None,
    optimizer_multiplier: float | None = None,
    allow_unmatched: bool = False,
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
) -> LayoutReport:
    """Check that `layout_map` fits `model` on `mesh`; report what it does.

    Works for any `keras.distribution.LayoutMap`: `plan_layout_map`'s,
    keras-hub's (`GemmaBackbone.get_layout_map(mesh)`, `LlamaBackbone`'s)
    or one written by hand. Each variable path is matched as Keras's
    `LayoutMap` matches it (an exact key first, else every pattern with
    `re.fullmatch`), and each layout is checked against the variable's
    shape and the mesh, so what would fail deep inside XLA, or silently
    replicate a weight, is a `ValueError` here naming the pattern and the
    variable. The model may be built with or without the distribution: the
    bytes per device are computed from the layouts; when its variables
    already live on the mesh, what the devices really hold is reported too.

    JAX only: on TensorFlow it raises `BackendNotSupportedError` (use
    `keras_mgpu.placement_report` with `apply_placement` there).

    Args:
        model: a built Keras model or layer (the variable paths to match).
        layout_map: `keras.distribution.LayoutMap`.
        mesh: `keras.distribution.DeviceMesh`; defaults to the map's. When
            given it must have the map's axis names and shape.
        optimizer: a Keras optimizer, to count its state per device (built:
            measured from its variables; unbuilt: measured on a copy built
            on the model's variables under `jax.eval_shape`, allocating
            nothing, so EMA, `amsgrad`, Adafactor's factored state count
            as built; `GradientAccumulationOptimizer` adds one copy for its
            accumulators, `LossScaleOptimizer` none). Optimizer variables
            take their variable's layout in Keras, so they are sharded
            alike.
        optimizer_multiplier: float >= 0, optimizer state in copies of the
            trainable variables, instead of `optimizer`.
        allow_unmatched: bool, list patterns that match nothing in the
            report instead of raising. Defaults to False.
        min_shard_bytes: int, kernels and embeddings from this size on that
            are replicated along every axis are listed as fallbacks.

    Returns:
        A `LayoutReport` (print it, or `.to_dict()`).

    Raises:
        ValueError: a pattern matching no variable (and no layer output),
            a variable matching several patterns (Keras refuses it at
            build time), a layout whose rank differs from its variable's,
            an axis the mesh lacks, or a dimension not divisible by the
            size of the axes splitting it; `mesh` differing from the map's.
        TypeError: `layout_map` is not a `LayoutMap`, `mesh` not a
            `DeviceMesh`.

    Example:

    ```python
    import keras
    import keras_mgpu.sharding
    mesh = keras.distribution.DeviceMesh(
        (1, 4), ("batch", "model"), keras.distribution.list_devices()[:4])
    inputs = keras.Input((64,))
    x = keras.layers.Dense(256, name="up")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(64, name="down")(x))
    layout_map = keras.distribution.LayoutMap(mesh)
    layout_map["up/kernel"] = (None, "model")
    report = keras_mgpu.sharding.check_layout_map(
        model, layout_map, optimizer=keras.optimizers.Adam())
    print(report)  # a table: variable, shape, axes, bytes per device
    report.fallbacks  # {'down/kernel': 'no pattern leaves this kernel ...'}
    ```
    """
    import keras

    require_jax("check_layout_map")
    check_model(model, "check_layout_map")
    if not isinstance(layout_map, keras.distribution.LayoutMap):
        raise TypeError(
            "Argument `layout_map` must be a keras.distribution.LayoutMap. "
            f"Received: layout_map of type {type(layout_map).__name__}"
        )
    if mesh is None:
        mesh = layout_map.device_mesh
    check_mesh(mesh)
    own = layout_map.device_mesh
    if own is not None and (
        tuple(own.axis_names) != tuple(mesh.axis_names)
        or tuple(own.shape) != tuple(mesh.shape)
    ):
        raise ValueError(
            "Argument `mesh` differs from the layout map's mesh: "
            f"mesh={tuple(mesh.shape)} {tuple(mesh.axis_names)}, layout "
            f"map's={tuple(own.shape)} {tuple(own.axis_names)}"
        )
    optimizer_multiplier = check_number(
        optimizer_multiplier,
        "optimizer_multiplier",
        minimum=0.0,
        allow_none=True,
    )
    if optimizer is not None and optimizer_multiplier is not None:
        raise ValueError(
            "Pass `optimizer` or `optimizer_multiplier`, not both. Received: "
            f"optimizer={type(optimizer).__name__}, "
            f"optimizer_multiplier={optimizer_multiplier}"
        )
    min_shard_bytes = check_int(min_shard_bytes, "min_shard_bytes", minimum=0)
    sizes = {name: int(size) for name, size in zip(mesh.axis_names, mesh.shape)}
    infos = _weights.describe(model)
    patterns = list(layout_map)
    for pattern in patterns:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(
                f"Pattern {pattern!r} of the layout map is not a regular "
                f"expression ({exc}); keras.distribution.LayoutMap matches "
                "keys with re.fullmatch."
            ) from None
    exact = set(patterns)
    matches: dict[str, list[str]] = {p: [] for p in patterns}
    rows = []
    replicated = []
    fallbacks: dict[str, str] = {}
    model_axes = [n for n in mesh.axis_names if sizes[n] > 1]
    for info in infos:
        if info.path in exact:  # Keras tries the exact key first
            hits = [info.path]
        else:
            hits = [p for p in patterns if re.fullmatch(p, info.path)]
        if len(hits) > 1:
            layouts = {p: _layout_axes(layout_map[p]) for p in hits}
            same = len(set(layouts.values())) == 1
            raise ValueError(
                f"Variable {info.path!r} matches several patterns of the "
                f"layout map: {layouts}"
                + (
                    " (the same layout, but keras.distribution.LayoutMap "
                    "refuses a path matching several patterns at build time)"
                    if same
                    else " with different layouts"
                )
                + ". Make each variable path match one pattern."
            )
        pattern = hits[0] if hits else None
        axes = None
        shards = 1
        if pattern is not None:
            matches[pattern].append(info.path)
            axes = _layout_axes(layout_map[pattern])
            _check_layout(pattern, axes, info, sizes)
            shards = math.prod(_axis_product(sizes, a) for a in axes)
        per_device = info.nbytes // shards
        if shards == 1:
            replicated.append(info.path)
            if (
                info.kind in ("kernel", "embedding", "generic")
                and info.nbytes >= min_shard_bytes
                and model_axes
            ):
                fallbacks[info.path] = (
                    "no pattern" if pattern is None else f"pattern {pattern!r}"
                ) + f" leaves this {info.kind} of {info.nbytes} bytes whole"
        rows.append(
            VariableRow(
                path=info.path,
                shape=info.shape,
                dtype=info.dtype,
                axes=axes,
                pattern=pattern,
                bytes=info.nbytes,
                bytes_per_device=per_device,
            )
        )
    outputs = _layer_output_paths(model)
    unmatched = []
    activation_patterns = {}
    for pattern in patterns:
        if matches[pattern]:
            continue
        hit = [p for p in outputs if re.fullmatch(pattern, p)]
        if hit:
            activation_patterns[pattern] = hit
            del matches[pattern]
            continue
        unmatched.append(pattern)
        if not allow_unmatched:
            example = infos[0].path
            raise ValueError(
                f"Pattern {pattern!r} of the layout map matches no variable "
                f"of model {model.name!r} (nor a layer output): its weights "
                "would silently stay replicated. Paths are matched whole "
                f"(re.fullmatch), e.g. {example!r}; layer names must be "
                "those of the model built under the distribution. Pass "
                "allow_unmatched=True to list it instead."
            )
    for pattern in unmatched:
        matches.pop(pattern, None)
    notes = getattr(layout_map, "_keras_mgpu_plan", None)
    if notes is not None:
        for path, reason in notes.fallbacks.items():
            fallbacks[path] = reason
    param_bytes = sum(info.nbytes for info in infos)
    per_device = sum(row.bytes_per_device for row in rows)
    trainable_ids = {id(v) for v in model.trainable_variables}
    trainable_rows = [
        row
        for row, info in zip(rows, infos)
        if id(info.variable) in trainable_ids
    ]
    if optimizer is not None:
        optimizer_multiplier = _optimizer_multiplier(
            optimizer,
            list(model.trainable_variables),
            sum(r.bytes for r in trainable_rows),
        )
    optimizer_bytes = None
    if optimizer_multiplier is not None:
        optimizer_bytes = int(
            round(
                optimizer_multiplier
                * sum(r.bytes_per_device for r in trainable_rows)
            )
        )
    return LayoutReport(
        mesh=sizes,
        variables=rows,
        matches=matches,
        unmatched_patterns=unmatched,
        activation_patterns=activation_patterns,
        replicated=replicated,
        fallbacks=fallbacks,
        param_bytes=param_bytes,
        param_bytes_per_device=per_device,
        optimizer_multiplier=optimizer_multiplier,
        optimizer_bytes_per_device=optimizer_bytes,
        measured_param_bytes_per_device=_measured(
            [info.variable for info in infos], mesh
        ),
        measured_optimizer_bytes_per_device=(
            _measured(list(optimizer.variables), mesh)
            if getattr(optimizer, "built", False)
            else None
        ),
        activations=_activations(infos, rows, sizes, _batch_axis(mesh, notes)),
        planner=notes,
    )


def _check_layout(pattern: str, axes: tuple, info: Any, sizes: dict) -> None:
    if len(axes) != len(info.shape):
        raise ValueError(
            f"Pattern {pattern!r} gives variable {info.path!r} of shape "
            f"{info.shape} (rank {len(info.shape)}) a layout of rank "
            f"{len(axes)}: {axes}"
        )
    used = []
    for dim, entry in enumerate(axes):
        if entry is None:
            continue
        names = entry if isinstance(entry, (tuple, list)) else (entry,)
        for name in names:
            if name not in sizes:
                raise ValueError(
                    f"Pattern {pattern!r} gives variable {info.path!r} the "
                    f"layout {axes}, naming axis {name!r}, which the mesh "
                    f"{list(sizes)} does not have"
                )
            if name in used:
                raise ValueError(
                    f"Pattern {pattern!r} gives variable {info.path!r} the "
                    f"layout {axes}, which uses axis {name!r} twice"
                )
            used.append(name)
        size = _axis_product(sizes, entry)
        if info.shape[dim] % size:
            raise ValueError(
                f"Pattern {pattern!r} splits dimension {dim} of variable "
                f"{info.path!r} (shape {info.shape}) over {entry!r} "
                f"({size} devices), which does not divide "
                f"{info.shape[dim]}"
            )


def _batch_axis(mesh: Any, notes: Any) -> str:
    """The mesh axis the batch is split along: the planner's `batch_axis`,
    else an axis named "batch", else the first axis (the default
    `batch_dim_name` of `keras.distribution.ModelParallel`)."""
    names = list(mesh.axis_names)
    planned = getattr(notes, "batch_axis", None)
    if planned in names:
        return planned
    return "batch" if "batch" in names else names[0]


def _feature_axes(entry: Any, sizes: dict, batch_axis: str) -> Any:
    """The part of a kernel's output-dimension layout entry that can split
    an activation's features: every axis but the batch axis (the batch
    dimension is split along it already; a `policy="balanced"` kernel split
    along it is gathered before use, as in fully sharded data parallel)."""
    names = entry if isinstance(entry, (tuple, list)) else (entry,)
    kept = tuple(
        n for n in names if n != batch_axis and _axis_product(sizes, n) > 1
    )
    if not kept:
        return None
    return kept[0] if len(kept) == 1 else kept


def _activations(
    infos: list, rows: list, sizes: dict, batch_axis: str
) -> dict[str, tuple]:
    """Output layouts of Dense/EinsumDense layers whose kernel splits an
    output dimension along a model axis: (batch dims..., that model axis on
    the feature dim). Only axes other than the batch axis split features."""
    found = {}
    for info, row in zip(infos, rows):
        if info.kind != "kernel" or row.axes is None:
            continue
        layer = info.layer
        feature_axes = {
            d: _feature_axes(row.axes[d], sizes, batch_axis)
            for d in info.output
            if row.axes[d] is not None
        }
        split = [d for d, axes in feature_axes.items() if axes is not None]
        if not split:
            continue
        layer_path = info.path.rsplit("/", 1)[0] + "/output"
        equation = getattr(layer, "equation", None)
        if equation:
            inputs, spec, output = equation.split("->")[0].split(",") + [
                equation.split("->")[1]
            ]
            axes = [None] * len(output)
            for d in split:
                axes[output.find(spec[d])] = feature_axes[d]
        elif len(info.shape) == 2:
            axes = ["..."] + [feature_axes[split[0]]]
        else:
            continue
        found[layer_path] = tuple(axes)
    return found

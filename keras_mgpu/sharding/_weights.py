"""What each weight of a model is, read from the layer that owns it.

A kernel's dimensions are either contracted with the layer's input or carried
to its output; a column split shards an output dimension, a row split a
contracted one. Keras's layers say which is which: `Dense` (in, out),
`EinsumDense` through its equation, convolutions (..., in, out), transposed
convolutions (..., out, in), `Embedding` (vocabulary, features) and
keras-hub's `ReversibleEmbedding.reverse_embeddings` (features, vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class WeightInfo:
    """One variable of the model and how its dimensions are used."""

    index: int
    variable: Any
    path: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    layer: Any
    # "kernel" (contracted / output dims known), "embedding", "bias",
    # "generic" (rank >= 2, use unknown) or "elementwise" (rank <= 1).
    kind: str
    contracted: tuple[int, ...] = ()
    output: tuple[int, ...] = ()
    # For a bias: the kernel it belongs to and, for each bias dimension,
    # the kernel dimension it follows (None: none).
    kernel_path: str | None = None
    kernel_dims: tuple[int | None, ...] = field(default_factory=tuple)


def nbytes_of(shape: tuple[int, ...], dtype: str) -> int:
    return int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize


def model_variables(model: Any) -> list[Any]:
    """`model.trainable_variables` then `model.non_trainable_variables`
    (the order `stateless_call` takes them in)."""
    return list(model.trainable_variables) + list(model.non_trainable_variables)


def _owners(model: Any) -> dict[int, Any]:
    """id(variable) -> the innermost layer holding it (the layer with the
    fewest weights among those that list it)."""
    import keras

    owners: dict[int, tuple[int, Any]] = {}
    stack = [model]
    seen = set()
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        weights = layer.weights
        for variable in weights:
            known = owners.get(id(variable))
            if known is None or len(weights) < known[0]:
                owners[id(variable)] = (len(weights), layer)
        for value in vars(layer).values():
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if isinstance(item, keras.layers.Layer):
                    stack.append(item)
        if isinstance(layer, keras.Model):
            stack.extend(layer.layers)
    return {key: layer for key, (_, layer) in owners.items()}


def _einsum_dims(equation: str) -> tuple[str, str, str]:
    left, output = equation.split("->")
    inputs, kernel = left.split(",")
    return inputs.strip(), kernel.strip(), output.strip()


def _is(layer: Any, name: str) -> bool:
    return any(cls.__name__ == name for cls in type(layer).__mro__)


def describe(model: Any) -> list[WeightInfo]:
    """A `WeightInfo` for each of `model_variables(model)`."""
    import keras

    owners = _owners(model)
    infos = []
    for index, variable in enumerate(model_variables(model)):
        shape = tuple(int(d) for d in variable.shape)
        dtype = keras.backend.standardize_dtype(variable.dtype)
        layer = owners.get(id(variable))
        info = WeightInfo(
            index=index,
            variable=variable,
            path=variable.path,
            shape=shape,
            dtype=dtype,
            nbytes=nbytes_of(shape, dtype),
            layer=layer,
            kind="elementwise" if len(shape) <= 1 else "generic",
        )
        _classify(info, layer)
        infos.append(info)
    return infos


def _classify(info: WeightInfo, layer: Any) -> None:
    """Fill `kind`, `contracted`, `output` (and a bias's kernel link)."""
    name = info.path.rsplit("/", 1)[-1]
    rank = len(info.shape)
    if layer is None:
        return
    try:
        kernel = getattr(layer, "kernel", None)
    except (AttributeError, ValueError):  # a quantized or unbuilt layer
        kernel = None
    kernel_path = getattr(kernel, "path", None)
    if _is(layer, "EinsumDense"):
        inputs, spec, output = _einsum_dims(layer.equation)
        if name == "kernel" and rank == len(spec):
            info.kind = "kernel"
            info.contracted = tuple(
                i for i, c in enumerate(spec) if c in inputs and c not in output
            )
            info.output = tuple(i for i, c in enumerate(spec) if c in output)
        elif name == "bias" and layer.bias_axes and kernel_path:
            first = min(output.find(c) for c in layer.bias_axes)
            letters = output[first:]
            if len(letters) == rank:
                info.kind = "bias"
                info.kernel_path = kernel_path
                info.kernel_dims = tuple(
                    spec.find(c) if c in layer.bias_axes and c in spec else None
                    for c in letters
                )
        return
    if _is(layer, "Dense") and rank == 2 and name == "kernel":
        info.kind, info.contracted, info.output = "kernel", (0,), (1,)
        return
    if _is(layer, "Dense") and rank == 1 and name == "bias" and kernel_path:
        info.kind, info.kernel_path, info.kernel_dims = (
            "bias",
            kernel_path,
            (1,),
        )
        return
    if _is(layer, "Embedding"):
        if name == "embeddings" and rank == 2:
            info.kind, info.contracted, info.output = "embedding", (), (0,)
        elif name == "reverse_embeddings" and rank == 2:
            info.kind, info.contracted, info.output = "kernel", (0,), (1,)
        return
    conv = type(layer).__name__
    if "Conv" in conv and "Depthwise" not in conv and rank >= 3:
        if name in ("kernel", "pointwise_kernel"):
            info.kind = "kernel"
            if "Transpose" in conv:
                info.output = (rank - 2,)
                info.contracted = (rank - 1,)
            else:
                info.output = (rank - 1,)
                info.contracted = (rank - 2,)
        return
    if "Conv" in conv and rank == 1 and name == "bias" and kernel_path:
        kernel_rank = len(kernel.shape)
        out = kernel_rank - 2 if "Transpose" in conv else kernel_rank - 1
        if "Depthwise" not in conv:
            info.kind, info.kernel_path, info.kernel_dims = (
                "bias",
                kernel_path,
                (out,),
            )

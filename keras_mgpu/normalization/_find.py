"""Finding the BatchNormalization layers of a model, and the remedy chosen
for each.

Shared by every remedy in `keras_mgpu.normalization` and by the components
that warn when a BatchNormalization model is split into micro-batches
without a choice made (`GradientAccumulationOptimizer`, `apply_placement`).
A remedy records itself on the layer instance with `mark_choice`; the mark
is set with `object.__setattr__`, so neither Keras flavour tracks it and
`get_config` never sees it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

# Attribute holding the remedy chosen for a BatchNormalization layer.
CHOICE_ATTR = "_keras_mgpu_batchnorm_choice"

# What each remedy records (see the `keras_mgpu.normalization` docstrings).
CHOICES = ("window", "momentum", "synchronized", "frozen", "accepted")

# Choices that address micro-batches (gradient accumulation, pipeline
# micro-batches). "synchronized" only addresses replicas.
MICRO_BATCH_CHOICES = ("window", "momentum", "frozen", "accepted")


def _batchnorm_classes() -> tuple[type, ...]:
    # Only flavours already imported can have made the layers we are given;
    # importing the other one here would cost seconds and change nothing.
    classes: list[type] = []
    keras3 = sys.modules.get("keras")
    if keras3 is not None and hasattr(keras3, "layers"):
        classes.append(keras3.layers.BatchNormalization)
    if "tf_keras" in sys.modules:
        # SyncBatchNormalization and BatchNormalization share this base.
        from tf_keras.src.layers.normalization.batch_normalization import (
            BatchNormalizationBase,
        )

        classes.append(BatchNormalizationBase)
    return tuple(classes)


def is_batchnorm(layer: Any) -> bool:
    """Whether `layer` is a BatchNormalization layer of either flavour
    (subclasses included)."""
    return isinstance(layer, _batchnorm_classes())


def _children(layer: Any) -> list:
    # Keras 3 and tf_keras both track sub-layers; `_flatten_layers` walks
    # nested models and layers that hold layers (keras-hub blocks).
    flatten = getattr(layer, "_flatten_layers", None)
    if flatten is None:
        return []
    return [child for child in flatten(include_self=False, recursive=False)]


def iter_batchnorm_layers(model: Any) -> Iterator[Any]:
    """Every BatchNormalization layer in `model`, nested models and layers
    included, each once, in tracking order."""
    seen: set[int] = set()
    stack = [model]
    while stack:
        layer = stack.pop(0)
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        if layer is not model and is_batchnorm(layer):
            yield layer
            continue
        stack[0:0] = _children(layer)


def batchnorm_layers(model: Any) -> list:
    """The BatchNormalization layers of `model` (see `iter_batchnorm_layers`).

    `model` itself counts when it is a BatchNormalization layer.
    """
    if is_batchnorm(model):
        return [model]
    return list(iter_batchnorm_layers(model))


def mark_choice(layer: Any, choice: str | None) -> None:
    """Record (or, with None, forget) the remedy chosen for `layer`."""
    if choice is not None and choice not in CHOICES:
        raise ValueError(
            f"`choice` must be one of {CHOICES} or None. Received: "
            f"choice={choice!r}"
        )
    object.__setattr__(layer, CHOICE_ATTR, choice)


def choice_of(layer: Any) -> str | None:
    """The remedy recorded for `layer`, or None."""
    return layer.__dict__.get(CHOICE_ATTR)


def unremedied_for_micro_batches(model: Any) -> list:
    """The BatchNormalization layers of `model` that normalise per
    micro-batch and whose statistics move per micro-batch with no remedy
    chosen: trainable, and not marked with a micro-batch choice."""
    return [
        layer
        for layer in batchnorm_layers(model)
        if layer.trainable and choice_of(layer) not in MICRO_BATCH_CHOICES
    ]

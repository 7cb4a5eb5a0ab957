"""Finding the BatchNormalization layers of a model, and the remedy chosen
for each.

Shared by every remedy in `keras_mgpu.normalization` and by the components
that warn when a BatchNormalization model is split into micro-batches
without a choice made (`GradientAccumulationOptimizer`, `apply_placement`).
A remedy records itself on the layer instance with `mark_choice`, and what
it changed (to undo it) with `saved`; both are set with
`object.__setattr__`, so neither Keras flavour tracks them and `get_config`
never sees them. Undoing every remedy removes both: the layer's `__dict__`
is the plain layer's again.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

# Attribute holding the remedy chosen for a BatchNormalization layer.
CHOICE_ATTR = "_keras_mgpu_batchnorm_choice"

# What each remedy records (see the `keras_mgpu.normalization` docstrings).
CHOICES = ("window", "momentum", "synchronized", "frozen", "accepted")

# What a remedy changed on a layer, so that undoing it puts it back:
# {remedy: {attribute: original value}} ("synchronized", "frozen",
# "window"); every record holds the "choice" the layer had before.
SAVED_ATTR = "_keras_mgpu_batchnorm_saved"

# Instance attribute of a layer switched by `use_window_statistics`: its
# `statistics` ("window" or "momentum"), None when not switched.
STATISTICS_ATTR = "_keras_mgpu_statistics"

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
    if choice is None:
        layer.__dict__.pop(CHOICE_ATTR, None)
        return
    object.__setattr__(layer, CHOICE_ATTR, choice)


def saved(layer: Any) -> dict:
    """The records of what remedies changed on `layer` (created empty)."""
    records = layer.__dict__.get(SAVED_ATTR)
    if records is None:
        records = {}
        object.__setattr__(layer, SAVED_ATTR, records)
    return records


def pop_saved(layer: Any, remedy: str) -> dict | None:
    """Take the record of `remedy` off `layer` (None when there is none);
    the records go with the last one."""
    records = layer.__dict__.get(SAVED_ATTR)
    if records is None:
        return None
    record = records.pop(remedy, None)
    if not records:
        layer.__dict__.pop(SAVED_ATTR, None)
    return record


def _in_force(layer: Any, choice: str) -> bool:
    """Whether the remedy `choice` names still holds on `layer`."""
    if choice in ("window", "momentum"):
        return layer.__dict__.get(STATISTICS_ATTR) == choice
    if choice in ("synchronized", "frozen"):
        return choice in (layer.__dict__.get(SAVED_ATTR) or {})
    return True  # "accepted": a mark only


def choice_after_undo(layer: Any, recorded: str | None) -> str | None:
    """The choice of `layer` once a remedy was undone: the one it had
    before (`recorded`) if that remedy still holds, else a remedy still in
    force (frozen, window statistics, synchronized: what the remedies
    would mark), else None. Remedies can be undone in any order."""
    if recorded is not None and _in_force(layer, recorded):
        return recorded
    records = layer.__dict__.get(SAVED_ATTR) or {}
    if "frozen" in records:
        return "frozen"
    statistics = layer.__dict__.get(STATISTICS_ATTR)
    if statistics is not None:
        return statistics
    if "synchronized" in records:
        return "synchronized"
    return None


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

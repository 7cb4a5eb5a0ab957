"""What a layer's `call` accepts, and whether a layer is placed: shared by
the wrappers that forward `training` and `mask` (RecomputeGrad,
PlacedLayer) and the graph rebuilds of recompute and placement."""

from __future__ import annotations

import inspect
from typing import Any


def accepts(layer: Any, argument: str) -> bool:
    """Whether `layer.call` names `argument` (Keras's own test for passing
    `training` and `mask`)."""
    try:
        return argument in inspect.signature(layer.call).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return False


# A class attribute of `keras_mgpu.placement.PlacedLayer`: `layers` sits
# below `placement` (which wraps recomputed layers), so it recognises a
# placed layer by this mark rather than by importing the class.
PLACED_MARK = "_keras_mgpu_placed"


def is_placed(layer: Any) -> bool:
    """Whether `layer` is a `keras_mgpu.placement` placed layer."""
    return getattr(type(layer), PLACED_MARK, False) is True

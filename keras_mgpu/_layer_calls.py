"""What a layer's `call` accepts: shared by the wrappers that forward
`training` and `mask` (RecomputeGrad, PlacedLayer) and the graph rebuilds
of recompute and placement."""

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

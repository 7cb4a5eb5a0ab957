"""The variables of a group of layers, each once: what both recomputation
engines (`keras_mgpu.backend.jax.recompute` and the TensorFlow one in
`keras_mgpu.layers._recompute_engine`) save, feed back or restore around a
recomputed region. It lives here, below both, so the backend never imports
a feature package."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any


def unique_variables(
    layers: Sequence[Any],
    attribute: str = "variables",
    keep: Callable[[Any], bool] | None = None,
) -> list:
    """Every variable in `layer.<attribute>` of `layers` (sublayers'
    included, as Keras lists them) that `keep` accepts, each once, in the
    order first met: a variable shared by two layers is state once."""
    found, seen = [], set()
    for layer in layers:
        for variable in getattr(layer, attribute):
            if keep is not None and not keep(variable):
                continue
            if id(variable) not in seen:
                seen.add(id(variable))
                found.append(variable)
    return found


__all__ = ["unique_variables"]

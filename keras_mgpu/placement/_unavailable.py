"""Under tf_keras (`TF_USE_LEGACY_KERAS=1`) placement is not available:
these stand-ins say so when called."""

from __future__ import annotations

from typing import Any


def _unavailable(function: str) -> None:
    raise NotImplementedError(
        f"`keras_mgpu.{function}` needs Keras 3 (TensorFlow backend); it is "
        "not available under tf_keras (TF_USE_LEGACY_KERAS=1). Unset "
        "TF_USE_LEGACY_KERAS to use model parallelism."
    )


def apply_placement(model: Any, *args: Any, **kwargs: Any) -> Any:
    """Not available under tf_keras (raises `NotImplementedError`)."""
    _unavailable("apply_placement")


def strip_placement(model: Any) -> Any:
    """Not available under tf_keras (raises `NotImplementedError`)."""
    _unavailable("strip_placement")


def placement_report(model: Any, *args: Any, **kwargs: Any) -> Any:
    """Not available under tf_keras (raises `NotImplementedError`)."""
    _unavailable("placement_report")

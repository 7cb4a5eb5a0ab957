"""Compression methods by name: `get` and its inverse `serialize`.

Kept apart from `base` (the interface), so that the methods import the
interface and this module imports the methods: no import circle.
"""

from __future__ import annotations

from typing import Any

from keras_mgpu.compression.base import GradientCompression
from keras_mgpu.compression.float_cast import FloatCompression
from keras_mgpu.compression.power_sgd import PowerSGD


def _methods() -> dict:
    return {
        "float16": lambda: FloatCompression("float16"),
        "bfloat16": lambda: FloatCompression("bfloat16"),
        "power_sgd": PowerSGD,
    }


_ALLOWED = (
    "None, 'float16', 'bfloat16', a keras_mgpu.compression.PowerSGD(rank=...)"
    " or another GradientCompression instance"
)


def get(identifier: Any) -> GradientCompression | None:
    """The compression method `identifier` names.

    Args:
        identifier: None (no compression), "float16", "bfloat16", a
            `GradientCompression` instance (e.g. `PowerSGD(rank=2)`), or the
            dict `serialize` makes of one.

    Raises:
        ValueError: an unknown name or config.
        TypeError: anything else.
    """
    if identifier is None or isinstance(identifier, GradientCompression):
        return identifier
    if isinstance(identifier, str):
        factory = _methods().get(identifier)
        if factory is None or identifier == "power_sgd":
            raise ValueError(
                "Argument `compression` must be one of "
                f"{_ALLOWED}. Received: compression={identifier!r}"
            )
        return factory()
    if isinstance(identifier, dict) and "method" in identifier:
        method = identifier["method"]
        methods = _methods()
        if method not in methods:
            raise ValueError(
                f"Unknown compression method {method!r} in config "
                f"{identifier!r}. Known methods: {', '.join(methods)}."
            )
        if method in ("float16", "bfloat16"):
            return methods[method]()
        return methods[method].from_config(identifier)
    raise TypeError(
        f"Argument `compression` must be {_ALLOWED}. Received: "
        f"compression={identifier!r} (of type {type(identifier).__name__})"
    )


def serialize(compression: GradientCompression | None) -> Any:
    """What `get` turns back into `compression`: None, a name, or a dict."""
    if compression is None:
        return None
    config = compression.get_config()
    if set(config) == {"method"}:
        return config["method"]
    return config

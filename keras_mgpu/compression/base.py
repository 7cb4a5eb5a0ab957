"""What a gradient compression method is to `GradientAccumulationOptimizer`:
the interface, the state it may keep, and the lookup of a method by name.

A method is a configuration object (no variables of its own, so one instance
may serve several optimizers). The optimizer asks it, at build time, which
state each trainable variable needs (`state_specs`) and creates that state as
optimizer variables; once per update, in replica context, it hands the
method each replica's share of the window's mean gradients and that state
(`all_reduce`), and gets back the whole mean on every replica, what must be
written back to the state if the update is applied, and whether the
method's own side information was finite.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from keras_mgpu._flavour import tf


class StateSpec(NamedTuple):
    """One optimizer variable a method keeps for one trainable variable.

    Attributes:
        name: suffix of the variable's name.
        shape: its shape.
        per_replica: True for a value each replica keeps for itself and of
            which only the sum over replicas matters (saved as that sum and
            restored as equal shares, like the accumulators); False for a
            value that is the same on every replica (saved once, restored to
            every replica).
        initial_value: a callable returning a NumPy array, or None for zeros.
    """

    name: str
    shape: tuple
    per_replica: bool
    initial_value: Callable[[], np.ndarray] | None = None


class Reduction(NamedTuple):
    """What `GradientCompression.all_reduce` returns.

    Attributes:
        means: the whole mean gradient, one tensor per gradient given, the
            same on every replica.
        finite: scalar bool tensor, False when the method's own side
            information (a scale, a factor) was not finite on some replica;
            the same on every replica.
        state_values: for each gradient, the new values of its state
            variables (in `state_specs` order), or an empty tuple: written
            only if the update is applied.
    """

    means: list
    finite: tf.Tensor
    state_values: list


class GradientCompression:
    """Base class of the ways the mean gradient may cross devices.

    Subclasses set `method` (the name `get` knows them by) and implement
    `all_reduce`; those that keep state implement `state_specs`, and those
    that start late implement `active`.
    """

    method: str = ""

    def state_specs(self, variable: Any, index: int) -> tuple:
        """The `StateSpec`s to create for trainable `variable` (the
        `index`-th the optimizer is built with). Default: none."""
        del variable, index
        return ()

    def active(self, updates: Any) -> tf.Tensor | None:
        """Whether to compress at this update, given the number of updates
        applied so far; None means always. Before that the mean crosses in
        float32."""
        del updates
        return None

    def all_reduce(
        self, context: Any, grads: list, states: list
    ) -> Reduction:  # pragma: no cover - abstract
        """In replica context: sum this replica's dense shares `grads` over
        the replicas, compressed, with `states` the state variables of each
        (tuples, as `state_specs` asked for)."""
        raise NotImplementedError

    def get_config(self) -> dict:
        return {"method": self.method}

    @classmethod
    def from_config(cls, config: dict) -> GradientCompression:
        config = dict(config)
        config.pop("method", None)
        return cls(**config)

    def __repr__(self) -> str:
        arguments = ", ".join(
            f"{k}={v!r}" for k, v in self.get_config().items() if k != "method"
        )
        return f"{type(self).__name__}({arguments})"

    def __eq__(self, other: object) -> bool:
        return (
            type(other) is type(self)
            and other.get_config() == self.get_config()  # type: ignore[attr-defined]
        )

    def __hash__(self) -> int:
        return hash(tuple(sorted(self.get_config().items())))


def _methods() -> dict:
    from keras_mgpu.compression.float_cast import FloatCompression
    from keras_mgpu.compression.power_sgd import PowerSGD

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

"""What a gradient compression method is to `GradientAccumulationOptimizer`:
the interface and the state it may keep (`StateSpec`, `Reduction`: what a
custom method's `state_specs` and `all_reduce` return).

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

"""Argument checks shared by every public constructor.

Each check raises at construction time with a message that names the
argument, echoes the value and says what is allowed, in Keras's own style:
"Argument `accumulation_steps` must be an integer >= 1. Received: ...".
"""

from __future__ import annotations

import numbers
import warnings
from collections.abc import Iterable
from typing import Any


def check_int(
    value: object,
    argument: str,
    *,
    minimum: int | None = None,
    allow_none: bool = False,
) -> int | None:
    """Return `value` as an int, or raise naming `argument`.

    Bools are rejected (they are ints in Python, but `True` steps is a bug).
    Floats are rejected even when integral: `4.0` steps usually means a
    computation went through float division by mistake.
    """
    if value is None and allow_none:
        return None
    allowed = "an integer" + (f" >= {minimum}" if minimum is not None else "")
    if allow_none:
        allowed += " or None"
    _check_kind(value, argument, allowed, numbers.Integral)
    if minimum is not None and value < minimum:
        raise _out_of_range(value, argument, allowed)
    return int(value)


def _check_kind(value: object, argument: str, allowed: str, kind: type) -> None:
    # Bools are ints and numbers to Python, never to an argument here.
    if isinstance(value, bool) or not isinstance(value, kind):
        raise TypeError(
            f"Argument `{argument}` must be {allowed}. "
            f"Received: {argument}={value!r} (of type {type(value).__name__})"
        )


def _out_of_range(value: object, argument: str, allowed: str) -> ValueError:
    return ValueError(
        f"Argument `{argument}` must be {allowed}. "
        f"Received: {argument}={value!r}"
    )


def check_number(
    value: object,
    argument: str,
    *,
    minimum: float | None = None,
    exclusive_minimum: bool = False,
    maximum: float | None = None,
    allow_none: bool = False,
) -> float | None:
    """Return `value` as a float, or raise naming `argument`."""
    if value is None and allow_none:
        return None
    bounds = []
    if minimum is not None:
        bounds.append(f"{'>' if exclusive_minimum else '>='} {minimum}")
    if maximum is not None:
        bounds.append(f"<= {maximum}")
    allowed = "a number" + (f" {' and '.join(bounds)}" if bounds else "")
    if allow_none:
        allowed += " or None"
    _check_kind(value, argument, allowed, numbers.Real)
    value = float(value)
    too_small = minimum is not None and (
        value <= minimum if exclusive_minimum else value < minimum
    )
    too_large = maximum is not None and value > maximum
    if too_small or too_large or value != value:  # NaN fails every bound
        raise _out_of_range(value, argument, allowed)
    return value


def check_choice(value: object, argument: str, choices: Iterable[str]) -> str:
    """Return `value` if it is one of `choices`, or raise naming `argument`."""
    choices = tuple(choices)
    if value not in choices:
        raise ValueError(
            f"Argument `{argument}` must be one of "
            f"{', '.join(repr(c) for c in choices)}. "
            f"Received: {argument}={value!r}"
        )
    return value  # type: ignore[return-value]


def check_bool(value: object, argument: str, allow_none: bool = False):
    """Return `value` if it is a bool (or None when allowed), else raise a
    `TypeError` naming `argument`."""
    if isinstance(value, bool) or (allow_none and value is None):
        return value
    allowed = "a bool or None" if allow_none else "a bool"
    raise TypeError(
        f"Argument `{argument}` must be {allowed}. Received: "
        f"{argument}={value!r} (of type {type(value).__name__})"
    )


def check_at_most_one(first: tuple[str, object], second: tuple[str, object]):
    """Raise a `ValueError` naming both arguments when both of the
    `(argument, value)` pairs are given (not None)."""
    (a, a_value), (b, b_value) = first, second
    if a_value is not None and b_value is not None:
        raise ValueError(
            f"Pass at most one of `{a}` and `{b}`. Received: "
            f"{a}={a_value!r}, {b}={b_value!r}"
        )


def renamed_argument(
    owner: str,
    deprecated: dict,
    old: str,
    new: str,
    value: Any,
    default: Any,
    stacklevel: int = 3,
) -> Any:
    """The value of argument `new`, taking it from `deprecated[old]` (the
    caller's `**deprecated` keywords) with a `FutureWarning` when the old
    name was used: arguments renamed in 0.2 keep their old name for one
    release. Both names given is a `TypeError`."""
    if old not in deprecated:
        return value
    if value is not default and value != default:
        raise TypeError(
            f"{owner}() got both `{new}` and its deprecated name `{old}`"
        )
    warnings.warn(
        f"{owner}: argument `{old}` is deprecated since keras_mgpu 0.2.0 "
        f"and will be removed in 0.3.0; use `{new}` instead.",
        FutureWarning,
        stacklevel=stacklevel,
    )
    return deprecated.pop(old)


def reject_unknown(owner: str, deprecated: dict) -> None:
    """Raise as Python does for keywords left after `renamed_argument`."""
    if deprecated:
        name = next(iter(deprecated))
        raise TypeError(
            f"{owner}() got an unexpected keyword argument {name!r}"
        )


def check_update_freq(value: object, argument: str = "update_freq") -> int:
    """`"epoch"` or an int >= 1 (batches), as Keras's `TensorBoard`:
    returns the batches between logs, 0 for per epoch only."""
    if value == "epoch":
        return 0
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(
            f"Argument `{argument}` must be 'epoch' or an integer >= 1. "
            f"Received: {argument}={value!r}"
        )
    if value < 1:
        raise ValueError(
            f"Argument `{argument}` must be 'epoch' or an integer >= 1. "
            f"Received: {argument}={value!r}"
        )
    return int(value)


def monitor_update_freq(
    owner: str, update_freq: object, deprecated: dict, stacklevel: int = 4
) -> tuple[object, int]:
    """A monitor's `update_freq` and the batches between its batch-level
    logs (0: per epoch only), taking the pre-0.2 `log_every_n_batches` (0
    meant per epoch) from the caller's `**deprecated` keywords with a
    `FutureWarning`; any other keyword left there is a `TypeError`."""
    if "log_every_n_batches" in deprecated:
        batches = deprecated["log_every_n_batches"]
        deprecated["log_every_n_batches"] = "epoch" if batches == 0 else batches
    update_freq = renamed_argument(
        owner,
        deprecated,
        "log_every_n_batches",
        "update_freq",
        update_freq,
        "epoch",
        # The user's line that built the monitor: 4 where the monitor's
        # `__init__` calls this function itself.
        stacklevel=stacklevel,
    )
    reject_unknown(owner, deprecated)
    return update_freq, check_update_freq(update_freq)

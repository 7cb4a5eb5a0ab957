"""What every monitor backend provides, and how it reports being unusable."""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class BackendUnavailable(RuntimeError):
    """A backend cannot sample here (no driver, no device, missing package).

    The monitors catch it, warn once and fall back; training goes on.
    """


class MonitorWarning(UserWarning):
    """Category of every warning the monitors emit.

    Filter it to silence them all:
    `warnings.filterwarnings("ignore", category=MonitorWarning)`.
    """


@runtime_checkable
class Backend(Protocol):
    """A source of samples for `Sampler`.

    `open()` acquires what sampling needs (raising `BackendUnavailable`
    when it cannot), `sample()` returns one flat `{name: float}` reading
    (NaN for a figure the device does not report; the names are the same at
    every call), `close()` releases everything and is safe to call twice and
    from another thread. `devices` names the devices sampled after `open()`.
    """

    devices: list[str]

    def open(self) -> None: ...

    def sample(self) -> dict[str, float]: ...

    def close(self) -> None: ...

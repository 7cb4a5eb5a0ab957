"""Device memory on JAX.

What the monitors read on Keras's JAX backend: `jax.Device.memory_stats()`
(GPU and TPU; None on CPU) through `JAXMemoryReader`, and the note that
XLA's GPU preallocation changes what the memory figures mean
(`preallocation_note`). Which devices a distribution uses, and their names,
are in `backend/jax/devices.py`.

Only imported where it is used; it imports `jax` inside its functions, so
importing it never starts JAX (nor TensorFlow).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from keras_mgpu.backend.jax.devices import MB, bytes_limit_mb, device_name

#: Environment variables of JAX's GPU allocator, read when JAX starts its
#: GPU backend (`jaxlib/xla_client.py`, jax 0.10).
PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"
ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"
MEM_FRACTION_ENVS = (
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
)


def _memory_stats(device: Any) -> Mapping[str, Any] | None:
    return device.memory_stats()


class JAXMemoryReader:
    """Reads `jax.Device.memory_stats()` for a process's devices.

    `bind(devices)` names JAX devices as TensorFlow does ("GPU:0", see
    `device_name`) and returns the names; `read(name)` then returns
    `{"current_mb", "peak_mb"}` from "bytes_in_use" and "peak_bytes_in_use",
    or None where JAX keeps no statistics (CPU devices: `memory_stats()` is
    None). `capacity_mb(name)` is "bytes_limit", what XLA's allocator may
    use (by default 75% of the GPU's memory, `XLA_PYTHON_CLIENT_MEM_FRACTION`).

    JAX cannot reset the peak: "peak_bytes_in_use" is the process's peak so
    far, and `reset` returns False.

    Args:
        memory_stats: callable or None (tests), taking a device and
            returning its statistics (a mapping of bytes, or None);
            `device.memory_stats()` when None.
    """

    def __init__(
        self,
        memory_stats: Callable[[Any], Mapping[str, Any] | None] | None = None,
    ) -> None:
        self._memory_stats = memory_stats or _memory_stats
        self._devices: dict[str, Any] = {}

    def bind(self, devices: Iterable[Any]) -> list[str]:
        """Name `devices` and remember them for `read`; returns the names."""
        names = []
        for device in devices:
            name = device_name(device)
            self._devices[name] = device
            if name not in names:
                names.append(name)
        return names

    def platform(self, name: str) -> str | None:
        device = self._devices.get(name)
        return None if device is None else str(device.platform)

    def stats(self, name: str) -> Mapping[str, Any] | None:
        device = self._devices.get(name)
        if device is None:
            return None
        try:
            return self._memory_stats(device)
        except Exception:  # a monitor never fails training
            return None

    def read(self, name: str) -> dict[str, float] | None:
        stats = self.stats(name)
        if not stats or "bytes_in_use" not in stats:
            return None
        current = float(stats["bytes_in_use"])
        peak = float(stats.get("peak_bytes_in_use", current))
        return {"current_mb": current / MB, "peak_mb": peak / MB}

    def reset(self, name: str) -> bool:
        """JAX keeps no resettable peak: always False."""
        return False

    def capacity_mb(self, name: str) -> float | None:
        return bytes_limit_mb(self.stats(name))


def preallocation_note(
    environ: Mapping[str, str] | None = None,
) -> str | None:
    """What XLA's GPU preallocation does to the memory figures, and how to
    turn it off; None when it is off (`XLA_PYTHON_CLIENT_PREALLOCATE=false`
    or `XLA_PYTHON_CLIENT_ALLOCATOR=platform`)."""
    environ = os.environ if environ is None else environ
    # JAX's own parsing: these three values turn preallocation off.
    if environ.get(PREALLOCATE_ENV, "") in ("false", "False", "0"):
        return None
    if environ.get(ALLOCATOR_ENV, "default").lower() == "platform":
        return None
    fraction = next(
        (environ[name] for name in MEM_FRACTION_ENVS if environ.get(name)),
        "0.75",
    )
    return (
        "XLA preallocates GPU memory when JAX starts "
        f"({PREALLOCATE_ENV} is not 'false'): this process holds a pool of "
        f"{fraction} of each GPU's memory (XLA_CLIENT_MEM_FRACTION) "
        "whatever the model needs, so the memory the GPU reports in use (NVML, "
        "nvidia-smi, GPULoadMonitor's gpu/..._mem_used) is the pool, not "
        "what training uses. To measure what training uses, set "
        f"{PREALLOCATE_ENV}=false (or {ALLOCATOR_ENV}=platform, slower) in "
        "the environment before JAX starts"
    )

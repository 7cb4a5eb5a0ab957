"""Device memory on JAX, and which devices a `keras.distribution` uses.

What the monitors read on Keras's JAX backend: `jax.Device.memory_stats()`
(GPU and TPU; None on CPU) through `JAXMemoryReader`, the local devices the
distribution in force computes on (`distribution_devices`), their CUDA
positions for NVML (`gpu_positions`), and the note that XLA's GPU
preallocation changes what the memory figures mean (`preallocation_note`).

Only imported where it is used; it imports `jax` inside its functions, so
importing it never starts JAX (nor TensorFlow).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from typing import Any

MB = 1024.0 * 1024.0

#: Environment variables of JAX's GPU allocator, read when JAX starts its
#: GPU backend (`jaxlib/xla_client.py`, jax 0.10).
PREALLOCATE_ENV = "XLA_PYTHON_CLIENT_PREALLOCATE"
ALLOCATOR_ENV = "XLA_PYTHON_CLIENT_ALLOCATOR"
MEM_FRACTION_ENVS = (
    "XLA_CLIENT_MEM_FRACTION",
    "XLA_PYTHON_CLIENT_MEM_FRACTION",
)


def _named_device(name: str) -> Any:
    """The JAX device of a Keras device name ("gpu:0"), as Keras resolves
    it (platform and global id)."""
    import jax

    kind, _, index = str(name).partition(":")
    for device in jax.devices(kind.lower()):
        if device.id == int(index or 0):
            return device
    raise ValueError(f"No JAX device named {name!r}")  # pragma: no cover


def _variable_devices(variables: Iterable[Any]) -> list[Any]:
    devices = []
    for variable in variables:
        value = getattr(variable, "value", variable)
        sharding = getattr(value, "sharding", None)
        if sharding is None:
            continue
        try:
            devices.extend(sorted(sharding.device_set, key=lambda d: d.id))
        except Exception:  # a purged or deleted array: nothing to add
            continue
    return devices


def distribution_devices(
    distribution: Any = None, variables: Iterable[Any] = ()
) -> list[Any]:
    """This process's JAX devices that `distribution` computes on, then
    those `variables` live on, in order, without duplicates.

    `distribution`: a `keras.distribution.Distribution`, or None for the
    one in force. Its mesh's devices (every process's after
    `keras.distribution.initialize()`; only this process's are kept).
    Without a distribution, JAX computes on its default device (the first
    GPU or TPU, else the CPU), as TensorFlow's default strategy does.
    """
    import jax

    from keras_mgpu.backend.jax.distribution import current_distribution

    distribution = current_distribution(distribution)
    devices: list[Any] = []
    if distribution is not None:
        devices.extend(
            _named_device(name)
            for name in distribution.device_mesh.devices.flatten()
        )
    else:
        devices.append(jax.local_devices()[0])
    devices.extend(_variable_devices(variables))
    here = jax.process_index()
    unique: list[Any] = []
    for device in devices:
        if device.process_index == here and device not in unique:
            unique.append(device)
    return unique


def device_name(device: Any) -> str:
    """TensorFlow's name of a JAX device: "GPU:1" for CUDA ordinal 1 of
    this process (`local_hardware_id`), "CPU:0", "TPU:3"."""
    index = getattr(device, "local_hardware_id", None)
    if index is None:
        index = device.id
    return f"{str(device.platform).upper()}:{int(index)}"


def local_gpus() -> list[Any]:
    """This process's JAX GPU devices ([] when JAX runs without a GPU)."""
    import jax

    try:
        return list(jax.local_devices(backend="gpu"))
    except RuntimeError:  # "Unknown backend gpu": no GPU plugin or device
        return []


def gpu_positions(distribution: Any = None) -> list[int] | None:
    """CUDA positions of the GPUs `distribution` (or the one in force) runs
    on, for `NvmlBackend(positions=...)`; None when JAX sees no GPU (NVML
    then samples every visible GPU, as on TensorFlow without GPUs)."""
    if not local_gpus():
        return None
    return sorted(
        {
            int(device_name(d).partition(":")[2])
            for d in distribution_devices(distribution)
            if d.platform == "gpu"
        }
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
        stats = self.stats(name) or {}
        limit = stats.get("bytes_limit")
        return float(limit) / MB if limit else None


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

"""Which JAX devices a `keras.distribution` computes on, and their names.

One place for what the monitors (`MemoryMonitor`, `GPULoadMonitor`) and
the batch finder (`find_batch_size`'s compiled-memory search) ask of JAX's
devices: a device from its name (`named_device`), the local devices the
distribution in force computes on (`distribution_devices`), TensorFlow's
name for a JAX device (`device_name`, "GPU:0": the monitors' log keys are
the same on both backends), CUDA positions for NVML (`gpu_positions`) and
what XLA's allocator may use on a device (`limit_mb`).

It imports `jax` inside its functions, so importing it never starts JAX
(nor TensorFlow).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

MB = 1024.0 * 1024.0


def named_device(name: Any, argument: str = "device") -> Any:
    """The JAX device named `name` as Keras names devices ("gpu:0",
    "cpu:1"; any case: "GPU:0" too), by platform and global id; a JAX
    device is returned as it is.

    Raises:
        ValueError: naming `argument`, the value and JAX's devices, where no
            device has that name.
    """
    import jax

    if isinstance(name, jax.Device):
        # A mesh built from JAX's devices (several processes) holds them.
        return name
    devices = {f"{d.platform}:{d.id}": d for d in jax.devices()}
    key = name.lower() if isinstance(name, str) else None
    if key is not None and ":" not in key:
        key += ":0"
    if key in devices:
        return devices[key]
    raise ValueError(
        f"Argument `{argument}` must be one of JAX's devices "
        f"{sorted(devices)}. Received: {argument}={name!r}"
    )


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
            named_device(name)
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


def bytes_limit_mb(stats: Mapping[str, Any] | None) -> float | None:
    """XLA's "bytes_limit" in `memory_stats()` figures, in MB; None where
    there is none (CPU devices report no statistics)."""
    limit = (stats or {}).get("bytes_limit")
    return float(limit) / MB if limit else None


def limit_mb(device: Any) -> float | None:
    """The memory XLA may use on `device` (`memory_stats()["bytes_limit"]`),
    in MB; None where the device reports none (CPU)."""
    try:
        stats = device.memory_stats()
    except Exception:  # noqa: BLE001 - unsupported on some platforms
        return None
    return bytes_limit_mb(stats)

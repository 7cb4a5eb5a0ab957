"""TensorFlow's allocator figures for the devices a strategy uses."""

from __future__ import annotations

from collections.abc import Callable


def _tf():
    """TensorFlow, imported on first use: the rest of
    `keras_mgpu.monitoring` (NVML, psutil, sampling) needs no framework."""
    from keras_mgpu._flavour import tf

    return tf


MB = 1024.0 * 1024.0


def strategy_devices(strategy=None, variables=()) -> list[str]:
    """Local devices ("GPU:0", "CPU:1", ...) that `strategy` computes or
    stores variables on, then those `variables` live on, in order, without
    duplicates.

    The default strategy places work on the first GPU, or on the CPU.
    Under `MultiWorkerMirroredStrategy` these are this worker's devices.
    `variables` adds the devices of a model split across devices
    (`keras_mgpu.apply_placement`), whose strategy sees only one.
    """
    strategy = strategy or _tf().distribute.get_strategy()
    names: list[str] = []
    try:
        names.extend(strategy.extended.worker_devices)
        names.extend(getattr(strategy.extended, "parameter_devices", ()))
    except (RuntimeError, NotImplementedError):  # the default strategy
        gpus = _tf().config.list_logical_devices("GPU")
        names.append(gpus[0].name if gpus else "CPU:0")
    for variable in variables:
        # A distributed variable's `.device` is its primary copy's.
        name = getattr(getattr(variable, "value", variable), "device", "")
        if name:
            names.append(name)
    devices: list[str] = []
    for name in names:
        spec = _tf().DeviceSpec.from_string(name)
        device = (
            f"{(spec.device_type or 'CPU').upper()}:{spec.device_index or 0}"
        )
        if device not in devices:
            devices.append(device)
    return devices


def logical_to_physical_gpu() -> dict[int, int]:
    """Map each logical GPU index to its physical GPU's position.

    Positions count the GPUs TensorFlow sees (`CUDA_VISIBLE_DEVICES` order,
    then `tf.config.set_visible_devices`). A physical GPU split into
    several logical devices maps all of them to its position.
    """
    mapping: dict[int, int] = {}
    logical = 0
    for physical in _tf().config.get_visible_devices("GPU"):
        position = int(physical.name.rsplit(":", 1)[-1])
        configs = _tf().config.get_logical_device_configuration(physical)
        for _ in range(len(configs) if configs else 1):
            mapping[logical] = position
            logical += 1
    return mapping


def logical_gpu_memory_limits_mb() -> dict[int, float]:
    """`memory_limit` (MB) of logical GPUs configured with one."""
    limits: dict[int, float] = {}
    logical = 0
    for physical in _tf().config.get_visible_devices("GPU"):
        configs = _tf().config.get_logical_device_configuration(physical)
        for config in configs or [None]:
            limit = getattr(config, "memory_limit", None)
            if limit:
                limits[logical] = float(limit)
            logical += 1
    return limits


def device_label(device: str) -> str:
    """Log label of a device: "GPU:1" -> "gpu1"."""
    kind, _, index = device.partition(":")
    return f"{kind.lower()}{index or 0}"


class TFMemoryReader:
    """Reads `tf.config.experimental.get_memory_info` for local devices.

    `read(device)` returns `{"current_mb", "peak_mb"}` or None when
    TensorFlow keeps no statistics for that device ("Allocator stats not
    available": a CPU with oneDNN off). `reset(device)` restarts the peak.
    On CPU the figures are process-wide: every logical CPU reports the
    same numbers (oneDNN on). `capacity_mb(device)` is the device's memory
    capacity when known (a logical device's `memory_limit`, else the GPU's
    total memory from NVML), else None.

    Args:
        get_memory_info: callable or None (tests); TensorFlow's when None.
        reset_memory_stats: callable or None (tests); TensorFlow's when
            None.
        gpu_totals_mb: callable or None returning `{position: MB}` of the
            physical GPUs; read through NVML when None.
    """

    def __init__(
        self,
        get_memory_info: Callable | None = None,
        reset_memory_stats: Callable | None = None,
        gpu_totals_mb: Callable[[], dict[int, float]] | None = None,
    ) -> None:
        self._get = get_memory_info or _tf().config.experimental.get_memory_info
        self._reset = (
            reset_memory_stats or _tf().config.experimental.reset_memory_stats
        )
        self._gpu_totals = gpu_totals_mb or _nvml_totals_mb

    def read(self, device: str) -> dict[str, float] | None:
        try:
            info = self._get(device)
        except (ValueError, RuntimeError, _tf().errors.OpError):
            return None
        return {
            "current_mb": info["current"] / MB,
            "peak_mb": info["peak"] / MB,
        }

    def reset(self, device: str) -> bool:
        try:
            self._reset(device)
        except (ValueError, RuntimeError, _tf().errors.OpError):
            return False
        return True

    def capacity_mb(self, device: str) -> float | None:
        kind, _, index = device.partition(":")
        if kind != "GPU":
            return None
        index = int(index or 0)
        limit = logical_gpu_memory_limits_mb().get(index)
        if limit:
            return limit
        position = logical_to_physical_gpu().get(index, index)
        try:
            totals = self._gpu_totals()
        except Exception:
            return None
        return totals.get(position)


def _nvml_totals_mb() -> dict[int, float]:
    """Total memory per visible GPU position through NVML ({} without)."""
    from keras_mgpu.monitoring.backend import BackendUnavailable
    from keras_mgpu.monitoring.nvml_backend import NvmlBackend

    backend = NvmlBackend()
    try:
        backend.open()
    except BackendUnavailable:
        return {}
    try:
        return {
            int(name[3:]): total
            for name, total in backend.total_memory_mb().items()
        }
    finally:
        backend.close()

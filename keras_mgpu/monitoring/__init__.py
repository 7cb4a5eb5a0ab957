"""Samplers and backends for the monitors (NVML, TF memory info, psutil).

The framework-free parts of `keras_mgpu.callbacks.MemoryMonitor` and
`keras_mgpu.callbacks.GPULoadMonitor`; see `log_keys` for the log-key
scheme.
"""

from keras_mgpu.monitoring.backend import (
    Backend,
    BackendUnavailable,
    MonitorWarning,
)
from keras_mgpu.monitoring.host_backend import HostBackend
from keras_mgpu.monitoring.nvml_backend import (
    NvmlBackend,
    visible_gpu_selectors,
)
from keras_mgpu.monitoring.sampler import Sampler
from keras_mgpu.monitoring.tf_memory import TFMemoryReader, strategy_devices

__all__ = [
    "Backend",
    "BackendUnavailable",
    "HostBackend",
    "MonitorWarning",
    "NvmlBackend",
    "Sampler",
    "TFMemoryReader",
    "strategy_devices",
    "visible_gpu_selectors",
]

"""Samplers and backends for the monitors (NVML, TF memory info, psutil),
and the communication arithmetic (`communication`: bytes per update,
predicted scaling).

The framework-free parts of `keras_mgpu.callbacks.MemoryMonitor` and
`keras_mgpu.callbacks.GPULoadMonitor`; see `log_keys` for the log-key
scheme.
"""

from keras_mgpu.monitoring.backend import (
    Backend,
    BackendUnavailable,
    MonitorWarning,
)
from keras_mgpu.monitoring.communication import (
    INTERCONNECTS,
    ScalingPrediction,
    UpdateTraffic,
    collective_bytes_from_hlo,
    predict_scaling,
    train_step_collectives,
    update_bytes,
)
from keras_mgpu.monitoring.host_backend import HostBackend
from keras_mgpu.monitoring.nvml_backend import (
    NvmlBackend,
    visible_gpu_selectors,
)
from keras_mgpu.monitoring.sampler import Sampler
from keras_mgpu.monitoring.tf_memory import TFMemoryReader, strategy_devices

__all__ = [
    "INTERCONNECTS",
    "Backend",
    "BackendUnavailable",
    "HostBackend",
    "MonitorWarning",
    "NvmlBackend",
    "Sampler",
    "ScalingPrediction",
    "TFMemoryReader",
    "UpdateTraffic",
    "collective_bytes_from_hlo",
    "predict_scaling",
    "strategy_devices",
    "train_step_collectives",
    "update_bytes",
    "visible_gpu_selectors",
]

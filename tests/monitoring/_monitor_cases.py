"""What both monitors' test modules (TensorFlow and JAX) expect: the
figures `GPULoadMonitor` logs per GPU, and the bad arguments each monitor
refuses at construction (the same on every backend)."""

from __future__ import annotations

GPU_FIGURES = [
    "util_mean_pct",
    "util_max_pct",
    "mem_used_mean_mb",
    "mem_used_max_mb",
    "mem_total_mb",
    "power_mean_w",
    "power_max_w",
    "temp_mean_c",
    "temp_max_c",
    "throttle_power_frac",
    "throttle_thermal_frac",
    "throttle_hw_frac",
]

# (kwargs, error, match) for `MemoryMonitor`.
MEMORY_MONITOR_BAD_INPUT = [
    ({"warn_fraction": 1.5}, ValueError, "Argument `warn_fraction` must be"),
    ({"capacity_mb": 0}, ValueError, "Argument `capacity_mb` must be"),
    (
        {"capacity_mb": {"gpu0": -1}},
        ValueError,
        r"`capacity_mb\['gpu0'\]` must be",
    ),
    ({"host": 1}, TypeError, "Argument `host` must be a bool"),
    ({"update_freq": 0}, ValueError, "`update_freq` must be 'epoch' or"),
    ({"update_freq": "batch"}, TypeError, "Received: update_freq='batch'"),
    ({"reader": object()}, TypeError, "unexpected keyword argument 'reader'"),
    ({"worker_prefix": 1}, TypeError, "`worker_prefix` must be a bool"),
    ({"gather_workers": "yes"}, TypeError, "`gather_workers` must be a bool"),
]

# (kwargs, error, match) for `GPULoadMonitor`.
GPU_LOAD_MONITOR_BAD_INPUT = [
    ({"interval": 0}, ValueError, "Argument `interval` must be"),
    ({"stall_utilization": 120}, ValueError, "`stall_utilization` must be"),
    ({"stall_utilization": -1}, ValueError, "`stall_utilization` must be"),
    (
        {"stall_memory_fraction": 0},
        ValueError,
        "`stall_memory_fraction` must be",
    ),
    ({"per_core": "yes"}, TypeError, "Argument `per_core` must be a bool"),
    ({"update_freq": -1}, ValueError, "`update_freq` must be 'epoch' or"),
    ({"backend": object()}, TypeError, "unexpected keyword argument"),
    ({"worker_prefix": "w0"}, TypeError, "`worker_prefix` must be a bool"),
    ({"gather_workers": 1}, TypeError, "`gather_workers` must be a bool"),
]

"""Stand-ins for JAX devices and their `memory_stats()` (CPU-only tests)."""

from __future__ import annotations

import types

MB = 1024 * 1024


def fake_device(platform: str, index: int, process_index: int = 0):
    """A JAX device as the monitors read it: platform, ids, process."""
    return types.SimpleNamespace(
        platform=platform,
        id=index,
        local_hardware_id=index,
        process_index=process_index,
    )


class FakeMemoryStats:
    """`memory_stats()` per fake device, in MB, mutable between readings.

    `devices`: {index: (in_use_mb, peak_mb, limit_mb or None)} for GPUs;
    any device not listed (a CPU) reports None, as JAX does on CPU.
    """

    def __init__(self, devices):
        self.devices = {k: list(v) for k, v in devices.items()}
        self.calls = 0

    def gpus(self):
        return [fake_device("gpu", i) for i in sorted(self.devices)]

    def __call__(self, device):
        self.calls += 1
        if device.platform != "gpu" or device.id not in self.devices:
            return None
        in_use, peak, limit = self.devices[device.id]
        stats = {
            "bytes_in_use": int(in_use * MB),
            "peak_bytes_in_use": int(peak * MB),
            "num_allocs": 3,
        }
        if limit is not None:
            stats["bytes_limit"] = int(limit * MB)
        return stats

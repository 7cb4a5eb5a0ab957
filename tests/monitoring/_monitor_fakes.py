"""Stand-ins for NVML, psutil and TensorFlow's memory info (CPU-only tests)."""

from __future__ import annotations

import types

MB = 1024 * 1024


class NVMLError(Exception):
    pass


class NVMLError_NotSupported(NVMLError):  # noqa: N801 - pynvml's name
    pass


class NVMLError_LibraryNotFound(NVMLError):  # noqa: N801 - pynvml's name
    pass


def gpu(
    uuid,
    util=50,
    used_mb=1000,
    total_mb=16000,
    power_w=200.0,
    temp_c=60,
    reasons=0,
    unsupported=(),
):
    """One fake GPU's readings; `unsupported` lists queries that raise."""
    return {
        "uuid": uuid,
        "util": util,
        "used_mb": used_mb,
        "total_mb": total_mb,
        "power_w": power_w,
        "temp_c": temp_c,
        "reasons": reasons,
        "unsupported": set(unsupported),
    }


class FakeNvml:
    """The slice of `pynvml` that `NvmlBackend` uses, with call counters."""

    NVMLError = NVMLError

    def __init__(self, gpus=(), fail_init=False):
        self.gpus = [dict(g) for g in gpus]
        self.fail_init = fail_init
        self.inits = 0
        self.shutdowns = 0

    @property
    def open_handles(self) -> int:
        return self.inits - self.shutdowns

    def nvmlInit(self):  # noqa: N802
        if self.fail_init:
            raise NVMLError_LibraryNotFound("NVML Shared Library Not Found")
        self.inits += 1

    def nvmlShutdown(self):  # noqa: N802
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):  # noqa: N802
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):  # noqa: N802
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid):  # noqa: N802
        raise NVMLError("not found")

    def nvmlDeviceGetUUID(self, handle):  # noqa: N802
        return self.gpus[handle]["uuid"].encode()  # old pynvml: bytes

    def _get(self, handle, query):
        g = self.gpus[handle]
        if query in g["unsupported"]:
            raise NVMLError_NotSupported("Not Supported")
        return g

    def nvmlDeviceGetUtilizationRates(self, handle):  # noqa: N802
        g = self._get(handle, "util")
        return types.SimpleNamespace(gpu=g["util"], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):  # noqa: N802
        g = self._get(handle, "memory")
        return types.SimpleNamespace(
            used=g["used_mb"] * MB,
            total=g["total_mb"] * MB,
            free=(g["total_mb"] - g["used_mb"]) * MB,
        )

    def nvmlDeviceGetPowerUsage(self, handle):  # noqa: N802
        return int(self._get(handle, "power")["power_w"] * 1000)

    def nvmlDeviceGetTemperature(self, handle, sensor):  # noqa: N802
        assert sensor == 0
        return self._get(handle, "temp")["temp_c"]

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle):  # noqa: N802
        return self._get(handle, "reasons")["reasons"]


class FakePsutil:
    """psutil: `cpu_percent`, `Process().memory_info()`, `virtual_memory()`."""

    def __init__(
        self, cores=(10.0, 90.0), rss_mb=500, total_mb=8000, available_mb=6000
    ):
        self.cores = list(cores)
        self.rss_mb = rss_mb
        self.total_mb = total_mb
        self.available_mb = available_mb

    def cpu_percent(self, interval=None, percpu=False):
        return list(self.cores) if percpu else sum(self.cores) / len(self.cores)

    def Process(self, pid):  # noqa: N802
        fake = self
        return types.SimpleNamespace(
            memory_info=lambda: types.SimpleNamespace(rss=fake.rss_mb * MB)
        )

    def virtual_memory(self):
        return types.SimpleNamespace(
            total=self.total_mb * MB, available=self.available_mb * MB
        )


class FakeTFMemory:
    """`get_memory_info`/`reset_memory_stats` for chosen devices (bytes)."""

    def __init__(self, devices, capacity=None):
        # devices: {"GPU:0": (current_mb, peak_mb)}; absent -> "not available"
        self.devices = {k: list(v) for k, v in devices.items()}
        self.capacity = capacity or {}
        self.resets = []

    def get_memory_info(self, device):
        if device not in self.devices:
            raise ValueError(f"Allocator stats not available for {device!r}")
        current, peak = self.devices[device]
        return {"current": int(current * MB), "peak": int(peak * MB)}

    def reset_memory_stats(self, device):
        if device not in self.devices:
            raise ValueError(f"Allocator stats not available for {device!r}")
        self.resets.append(device)
        self.devices[device][1] = self.devices[device][0]

    def reader(self):
        from keras_mgpu.monitoring import TFMemoryReader

        reader = TFMemoryReader(
            self.get_memory_info,
            self.reset_memory_stats,
            gpu_totals_mb=lambda: {},
        )
        reader.capacity_mb = lambda device: self.capacity.get(device)
        return reader

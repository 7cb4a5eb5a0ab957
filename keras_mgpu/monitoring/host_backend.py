"""Host figures from psutil: CPU use per core, process and system memory."""

from __future__ import annotations

import os

from keras_mgpu.monitoring.backend import BackendUnavailable

MB = 1024.0 * 1024.0


class HostBackend:
    """Samples this machine's CPUs and memory through `psutil`.

    `sample()` returns `core{i}_util` (percent busy per logical core since
    the previous reading) and `util` (their mean). `memory()` returns the
    process's resident set size and the system's memory in MB.

    Args:
        psutil_module: the `psutil` module or a stand-in (tests); imported
            when None.
        pid: int or None, the process to measure; this one when None.
    """

    def __init__(self, psutil_module=None, pid: int | None = None) -> None:
        self._psutil = psutil_module
        self._pid = pid if pid is not None else os.getpid()
        self._process = None
        self.devices: list[str] = []

    def _module(self):
        if self._psutil is None:
            try:
                import psutil
            except ImportError as exc:  # pragma: no cover - a core dependency
                raise BackendUnavailable(
                    "psutil is not installed: pip install psutil"
                ) from exc
            self._psutil = psutil
        return self._psutil

    def open(self) -> None:
        psutil = self._module()
        self._process = psutil.Process(self._pid)
        cores = len(psutil.cpu_percent(interval=None, percpu=True))
        self.devices = [f"core{i}" for i in range(cores)]

    def sample(self) -> dict[str, float]:
        """CPU percent per core since the previous call (or `open()`)."""
        per_core = self._module().cpu_percent(interval=None, percpu=True)
        sample = {f"core{i}_util": float(v) for i, v in enumerate(per_core)}
        sample["util"] = (
            float(sum(per_core) / len(per_core)) if per_core else 0.0
        )
        return sample

    def memory(self) -> dict[str, float]:
        """Process RSS and system memory (used, available, total) in MB."""
        psutil = self._module()
        if self._process is None:
            self._process = psutil.Process(self._pid)
        rss = self._process.memory_info().rss
        system = psutil.virtual_memory()
        return {
            "rss_mb": rss / MB,
            "system_used_mb": (system.total - system.available) / MB,
            "system_available_mb": system.available / MB,
            "system_total_mb": system.total / MB,
        }

    def close(self) -> None:
        self._process = None

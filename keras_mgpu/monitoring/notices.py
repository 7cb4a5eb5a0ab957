"""Warn once: each monitor message is emitted once per run (or process)."""

from __future__ import annotations

import warnings

from keras_mgpu.monitoring.backend import MonitorWarning

# Notes that hold for the whole process (e.g. how TensorFlow reports CPU
# memory) are given once per process, not once per `fit`.
_PROCESS_NOTES: set[str] = set()


class Notices:
    """Emits each warning `key` once until `reset()` (a new run)."""

    def __init__(self) -> None:
        self._seen: set[str] = set()

    def reset(self) -> None:
        self._seen.clear()

    def warn(self, key: str, message: str, per_process: bool = False) -> bool:
        """Warn with `message` unless `key` was already warned about."""
        seen = _PROCESS_NOTES if per_process else self._seen
        if key in seen:
            return False
        seen.add(key)
        warnings.warn(message, MonitorWarning, stacklevel=3)
        return True

"""Per-window statistics of samples: mean, max, min and count per figure.

The aggregation math of the monitors, written once. NaN readings (a figure
a device does not report) are left out of the statistics; a figure with no
finite reading in the window has mean/max/min NaN.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from typing import NamedTuple

NAN = float("nan")


class Stats(NamedTuple):
    """Statistics of one figure over one window."""

    mean: float
    max: float
    min: float
    count: int


class Aggregator:
    """Thread-safe running mean/max/min of `{name: float}` samples.

    `add()` is called from the sampling thread, `collect()` from the
    training thread; `collect()` returns the window's statistics and starts
    a new window.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sums: dict[str, float] = {}
        self._maxs: dict[str, float] = {}
        self._mins: dict[str, float] = {}
        self._counts: dict[str, int] = {}
        self._samples = 0
        self._latest: dict[str, float] = {}

    def add(self, sample: Mapping[str, float]) -> None:
        with self._lock:
            self._samples += 1
            self._latest = dict(sample)
            for name, value in sample.items():
                value = float(value)
                self._counts.setdefault(name, 0)
                if math.isnan(value):
                    continue
                if self._counts[name] == 0:
                    self._sums[name] = value
                    self._maxs[name] = value
                    self._mins[name] = value
                else:
                    self._sums[name] += value
                    self._maxs[name] = max(self._maxs[name], value)
                    self._mins[name] = min(self._mins[name], value)
                self._counts[name] += 1

    @property
    def samples(self) -> int:
        """Samples added in the current window."""
        with self._lock:
            return self._samples

    def latest(self) -> dict[str, float]:
        """The last sample added (kept across windows)."""
        with self._lock:
            return dict(self._latest)

    def collect(self) -> dict[str, Stats]:
        """Statistics of the current window; then start a new one."""
        with self._lock:
            result = {}
            for name, count in self._counts.items():
                if count:
                    result[name] = Stats(
                        self._sums[name] / count,
                        self._maxs[name],
                        self._mins[name],
                        count,
                    )
                else:
                    result[name] = Stats(NAN, NAN, NAN, 0)
            self._sums.clear()
            self._maxs.clear()
            self._mins.clear()
            self._counts.clear()
            self._samples = 0
            return result


def spread(values: Iterable[float]) -> float:
    """Busiest minus idlest of finite `values`: 0.0 for one, NaN for none."""
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return NAN
    return max(finite) - min(finite)

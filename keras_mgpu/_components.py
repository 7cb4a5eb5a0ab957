"""Which keras_mgpu components run on the backend in use, read by building
each one: a component either constructs (it works there) or refuses at
construction with `BackendNotSupportedError` naming what to use instead
(`keras_mgpu.backend.require_backend`). `keras-mgpu info` prints the table;
the demo uses a component only where it constructs."""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from typing import Any


def _probes() -> dict[str, Callable[[], Any]]:
    """Public name -> a function building that component the cheapest way
    (no training, no files, no threads: only the constructor runs)."""
    import keras_mgpu
    from keras_mgpu import callbacks, compression
    from keras_mgpu._flavour import keras

    def backup_and_restore() -> Any:
        with tempfile.TemporaryDirectory() as folder:
            return callbacks.BackupAndRestore(folder)

    return {
        "GradientAccumulationOptimizer": lambda: (
            keras_mgpu.GradientAccumulationOptimizer(
                keras.optimizers.SGD(0.1), 2
            )
        ),
        "LearningRateScaler": lambda: callbacks.LearningRateScaler(
            base_batch_size=32, per_replica_batch_size=32
        ),
        "LearningRateWarmup": lambda: callbacks.LearningRateWarmup(
            warmup_epochs=1
        ),
        "schedules.Warmup": lambda: keras_mgpu.Warmup(0.1, 10),
        "MemoryMonitor": lambda: callbacks.MemoryMonitor(),
        "GPULoadMonitor": lambda: callbacks.GPULoadMonitor(),
        "ThroughputMonitor": lambda: callbacks.ThroughputMonitor(),
        "RecomputeGrad": lambda: keras_mgpu.RecomputeGrad(
            keras.layers.Dense(1)
        ),
        "BackupAndRestore": backup_and_restore,
        "WorkerWatchdog": lambda: callbacks.WorkerWatchdog(),
        "StragglerMonitor": lambda: callbacks.StragglerMonitor(),
        "PruningStepSync": lambda: callbacks.PruningStepSync(),
        "PowerSGD": lambda: compression.PowerSGD(),
        "FloatCompression": lambda: compression.FloatCompression(),
        "apply_placement": lambda: keras_mgpu.apply_placement(
            keras.Sequential()
        ),
    }


def construct(build: Callable[[], Any]) -> tuple[Any, str | None]:
    """`(build(), None)`, or `(None, why)` when the component refuses the
    backend (`BackendNotSupportedError`). Other errors propagate: they are
    bugs, not a backend's limits."""
    from keras_mgpu.backend import BackendNotSupportedError

    try:
        return build(), None
    except BackendNotSupportedError as exc:
        return None, str(exc)


#: The start of `why` for a component that failed to construct with another
#: error than a refusal (a bug, or a missing dependency).
FAILED = "failed at construction"


def support_table() -> list[tuple[str, bool, str]]:
    """`(component, works here, why not)` for every probed component."""
    rows = []
    for name, build in _probes().items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. "no NVML": not the point
            try:
                _, why = construct(build)
            except Exception as exc:  # not a refusal: say what it was
                why = f"{FAILED} ({type(exc).__name__}: {exc})"
        rows.append((name, why is None, why or ""))
    return rows


def instead_of(reason: str) -> str:
    """The "use X instead" part of a refusal, or its first sentence."""
    marker = ", use "
    if marker in reason:
        return "use " + reason.split(marker, 1)[1].rstrip(".")
    return reason.split(". ")[0].rstrip(".")

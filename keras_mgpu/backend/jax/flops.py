"""FLOPs of a model's JAX training step, from XLA's cost analysis, and a
count of XLA compilations, for `ThroughputMonitor`.

The step is lowered (traced to StableHLO), never compiled or run: XLA's HLO
cost analysis of the lowered module counts every floating-point operation
of the program as written for the *global* batch (before the SPMD
partitioner splits it over a `keras.distribution`'s mesh), so per-sample
figures divide by the global batch. Lowering costs one trace of the step
(a fraction of its compile time) and is done once per batch shape.

- Hardware FLOPs: the whole `model.train_step` (forward, backward with its
  recomputation from `jax.checkpoint` regions, loss, metrics and the
  optimizer's update), as Keras's trainer jits it.
- Model FLOPs: 3 x the forward pass in training mode (`stateless_call`),
  the usual convention (PaLM, Megatron) that the backward pass costs twice
  the forward; recompute is not counted.

Compilations are counted through `jax.monitoring`'s duration events
(`/jax/core/compile/backend_compile_duration` and the tracing and lowering
events before it), with the wall time each took, so a caller can leave
compile time out of its rates.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np

_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_BEFORE_COMPILE = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
)


class _CompileLog:
    """Process-wide log of XLA compilations: (end time, seconds, is a
    backend compile). One listener, registered on first use (JAX keeps
    listeners for the life of the process)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float, bool]] = []
        self._lock = threading.Lock()
        self._registered = False

    def ensure_listening(self) -> None:
        if self._registered:
            return
        import jax

        jax.monitoring.register_event_duration_secs_listener(self._on_event)
        self._registered = True

    def _on_event(self, event: str, duration: float, **_: Any) -> None:
        if event == _COMPILE_EVENT or event in _BEFORE_COMPILE:
            with self._lock:
                self.events.append(
                    (time.perf_counter(), duration, event == _COMPILE_EVENT)
                )
                if len(self.events) > 100_000:  # bounded in long processes
                    del self.events[:50_000]

    def since(self, start: float) -> tuple[int, float, list]:
        """Compilations ended after `start` (a `time.perf_counter()`):
        their count, their seconds (tracing + lowering + XLA compile) and
        the events (end, seconds, is_compile)."""
        with self._lock:
            events = [e for e in self.events if e[0] >= start]
        count = sum(1 for e in events if e[2])
        return count, sum(e[1] for e in events), events


COMPILE_LOG = _CompileLog()


def _abstract(value: Any) -> Any:
    import jax

    if value is None:
        return None
    return jax.ShapeDtypeStruct(
        value.shape, value.dtype, sharding=getattr(value, "sharding", None)
    )


def abstract_batch(batch: Any) -> Any:
    """`batch` (a structure of arrays) as shapes, dtypes and shardings."""
    import jax

    return jax.tree_util.tree_map(_abstract, batch)


def _inputs(data: Any) -> Any:
    # Keras's `unpack_x_y_sample_weight`: a tuple (x,), (x, y) or
    # (x, y, sample_weight), else x alone.
    if isinstance(data, tuple) and 1 <= len(data) <= 3:
        return data[0]
    return data


def _flops(lowered: Any) -> float:
    analysis = lowered.cost_analysis()
    if isinstance(analysis, (list, tuple)):  # older JAX: one per module
        analysis = analysis[0]
    return float((analysis or {}).get("flops", float("nan")))


def step_flops(model: Any, batch: Any) -> dict[str, float]:
    """FLOPs of one training step of `model` on `batch` (a structure of
    `jax.ShapeDtypeStruct`, the global batch as `fit` feeds it):
    {"model": 3 x forward, "hardware": the whole train step}. Call it under
    the distribution the model trains with (inside `fit` it is in force).
    """
    import jax

    variables = (
        model.trainable_variables,
        model.non_trainable_variables,
        model.optimizer.variables,
        model.metrics_variables,
    )
    state = tuple([_abstract(v.value) for v in group] for group in variables)
    hardware = _flops(jax.jit(model.train_step).lower(state, batch))

    def forward(trainable, non_trainable, x):
        return model.stateless_call(trainable, non_trainable, x, training=True)

    model_flops = 3.0 * _flops(
        jax.jit(forward).lower(state[0], state[1], _inputs(batch))
    )
    return {"model": model_flops, "hardware": hardware}


def device_count_and_kind(distribution: Any = None) -> tuple[int, str]:
    """How many devices compute the step (the distribution's mesh over
    every process, or every device JAX sees), and the first one's kind
    ("cpu" on CPU)."""
    import jax

    count, devices = 1, None
    mesh = getattr(distribution, "device_mesh", None)
    if mesh is not None:
        count = int(np.size(mesh.devices))
        backend_mesh = getattr(mesh, "backend_mesh", None)
        devices = list(np.ravel(getattr(backend_mesh, "devices", [])))
    if not devices:
        devices = [jax.devices()[0]]
    device = devices[0]
    kind = getattr(device, "device_kind", "") or device.platform
    if getattr(device, "platform", "") == "cpu":
        kind = "cpu"
    return count, str(kind)

"""FLOPs of a model's TensorFlow training step, counted on its traced
graph, for `ThroughputMonitor`.

The step is traced into a `tf.function` graph, never run, and TensorFlow's
graph profiler (`tf.compat.v1.profiler`, `float_operation` view) sums the
FLOPs its ops register (MatMul, BatchMatMul, Einsum, Conv, element-wise
arithmetic, reductions, ...) from their static shapes. Measured with
Keras 3.15 / TF 2.21: a Dense MLP's forward pass within 0.2% of
2 x weights x batch; a keras-hub GPT-2 backbone's 4.8% under XLA's count of
the same forward (the profiler registers no cost for some element-wise ops
XLA counts, as GELU's and softmax's transcendentals).

- Model FLOPs: 3 x the forward pass in training mode (the backward pass
  costs twice the forward), the MFU convention.
- Hardware FLOPs: the graph of `model.train_step` traced under the model's
  strategy (`strategy.run`, one replica's batch on every replica), its
  gradient included; recompute (`tf.recompute_grad`) shows there as the
  forward ops its gradient function re-runs when TensorFlow puts them in
  the graph. None when the step cannot be traced outside `fit`.
XLA's own cost analysis is not reachable from TensorFlow's Python API
(`experimental_get_compiler_ir` gives HLO text, no cost), hence the graph
profiler.
"""

from __future__ import annotations

from typing import Any


def _graph_flops(concrete: Any) -> float:
    import tensorflow as tf

    options = tf.compat.v1.profiler.ProfileOptionBuilder.float_operation()
    options["output"] = "none"
    profile = tf.compat.v1.profiler.profile(
        graph=concrete.graph, options=options
    )
    return float(profile.total_float_ops)


def _inputs(data: Any) -> Any:
    if isinstance(data, tuple) and 1 <= len(data) <= 3:
        return data[0]
    return data


def step_flops(
    model: Any, per_replica_batch: Any, strategy: Any
) -> dict[str, float | None]:
    """FLOPs of one training step of `model` over all replicas of
    `strategy`, each given `per_replica_batch` (a structure of
    `tf.TensorSpec` with a static batch dimension): {"model": 3 x forward,
    "hardware": the traced train step or None}."""
    import tensorflow as tf

    replicas = max(1, int(getattr(strategy, "num_replicas_in_sync", 1)))
    x_spec = _inputs(per_replica_batch)
    forward = tf.function(lambda x: model(x, training=True))
    model_flops = (
        3.0 * replicas * _graph_flops(forward.get_concrete_function(x_spec))
    )
    hardware = None
    try:

        def step(data):
            return strategy.run(model.train_step, args=(data,))

        hardware = _graph_flops(
            tf.function(step).get_concrete_function(per_replica_batch)
        )
    except Exception:  # noqa: BLE001 - a step that only traces inside fit
        hardware = None
    return {"model": model_flops, "hardware": hardware}


def device_count_and_kind(strategy: Any) -> tuple[int, str]:
    """How many devices compute the step (the strategy's replicas over all
    workers) and the kind of this worker's first GPU ("cpu" without)."""
    import tensorflow as tf

    count = max(1, int(getattr(strategy, "num_replicas_in_sync", 1)))
    kind = "cpu"
    try:
        gpus = tf.config.list_physical_devices("GPU")
        if gpus:
            details = tf.config.experimental.get_device_details(gpus[0])
            kind = str(details.get("device_name", "gpu"))
    except Exception:  # noqa: BLE001 - no details on some builds
        pass
    return count, kind


def tracing_count(function: Any) -> int | None:
    """Traces so far of Keras's train function: its `tf.function`s'
    `experimental_get_tracing_count()`, summed. Keras 3.15's TensorFlow
    trainer returns a Python closure over them (`_make_function`), so the
    closure's cells are searched, two levels deep; None when none is
    found."""
    found: list = []

    def visit(candidate: Any, depth: int) -> None:
        if candidate is None or depth > 2 or any(candidate is f for f in found):
            return
        if hasattr(candidate, "experimental_get_tracing_count"):
            found.append(candidate)
            candidate = getattr(candidate, "python_function", None)
        for cell in getattr(candidate, "__closure__", None) or ():
            try:
                visit(cell.cell_contents, depth + 1)
            except ValueError:  # an empty cell
                continue

    visit(function, 0)
    if not found:
        return None
    return sum(int(f.experimental_get_tracing_count()) for f in found)

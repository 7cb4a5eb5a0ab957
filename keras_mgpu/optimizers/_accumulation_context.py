"""Where the Keras 3 `GradientAccumulationOptimizer` step runs, and what it
must do there: the checks of the step's context (XLA, several steps per
execution, the strategy's all-reduce, what this Keras version supports),
the skipping of the inner optimizer's own cross-replica reduction when the
wrapper has reduced already, and how a gradient is shared between replicas
and accumulated (dense, sparse or maximum slots)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from keras_mgpu._flavour import (
    keras_of,
    tf,
)
from keras_mgpu.backend import (
    ON_JAX_NO_COMPRESSION,
    require_backend,
)
from keras_mgpu.distribute import strategy_kind
from keras_mgpu.optimizers._accumulation_common import (
    DENSE,
    MAXIMUM,
    SPARSE,
    is_sparse,
    overwrites_with_gradient,
)

# Keras 3 whatever TF_USE_LEGACY_KERAS says (see `gradient_accumulation`).
keras = keras_of("keras3")


def _has_clipping(optimizer: Any) -> bool:
    return bool(
        optimizer.clipnorm or optimizer.global_clipnorm or optimizer.clipvalue
    )


def _in_xla_context() -> bool:
    """Whether the graph being traced is compiled with XLA (jit_compile).

    Uses TensorFlow's private `control_flow_util` (TF 2.16-2.21): there is
    no public way to ask this while tracing.
    """
    from tensorflow.python.ops import control_flow_util

    return control_flow_util.GraphOrParentsInXlaContext(
        tf.compat.v1.get_default_graph()
    )


def _in_multi_step_loop() -> bool:
    """Whether tracing happens inside Keras's `steps_per_execution` loop.

    Keras 3.15 runs `steps_per_execution > 1` as a `tf.while_loop`; its
    body graph is named "while_body_*" (checked through outer graphs).
    """
    graph = tf.compat.v1.get_default_graph()
    while graph is not None:
        if getattr(graph, "name", "").startswith("while_body"):
            return True
        graph = getattr(graph, "outer_graph", None)
    return False


def _uses_collective_all_reduce(strategy: tf.distribute.Strategy) -> bool:
    # Private attribute (TF 2.16-2.21): MirroredStrategy keeps the cross-
    # device ops it was given, or its CollectiveAllReduce default, there.
    ops = getattr(strategy.extended, "_cross_device_ops", None)
    return type(ops).__name__ == "CollectiveAllReduce"


def _check_jax_compression(compression: Any) -> None:
    """Off TensorFlow: gradient compression is refused at construction
    (XLA runs the step's reductions). Returns the method: None."""
    if compression is not None:
        require_backend(
            "GradientAccumulationOptimizer(compression=...)",
            ("tensorflow",),
            instead=ON_JAX_NO_COMPRESSION,
        )
    return None


def _check_keras_limits() -> None:
    """Raise clearly where Keras itself cannot run the combination, instead
    of letting it fail later with an obscure graph-execution error.

    Measured with Keras 3.15 / TensorFlow 2.21 on CPU (see the README's
    compatibility table and tests/test_keras_limits.py).
    """
    if not tf.distribute.has_strategy():
        return
    strategy = tf.distribute.get_strategy()
    if strategy_kind(strategy) != "mirrored":
        return
    devices = tuple(getattr(strategy.extended, "worker_devices", ()))
    all_gpu = bool(devices) and all("GPU" in d.upper() for d in devices)
    if _in_xla_context() and not all_gpu:
        raise ValueError(
            "jit_compile=True under MirroredStrategy on non-GPU devices "
            f"({', '.join(devices)}) fails in Keras {keras.version()} "
            "itself (XLA reads a resource on another device), with or "
            "without GradientAccumulationOptimizer. Compile the model with "
            "jit_compile=False."
        )
    if _in_multi_step_loop() and _uses_collective_all_reduce(strategy):
        raise ValueError(
            "steps_per_execution > 1 under MirroredStrategy with its default "
            "CollectiveAllReduce fails in Keras "
            f"{keras.version()} itself ('You must feed a value for "
            "placeholder tensor' in its multi-step loop), with or without "
            "GradientAccumulationOptimizer. Either compile with "
            "steps_per_execution=1, or build the strategy with "
            "cross_device_ops=tf.distribute.ReductionToOneDevice() (or "
            "HierarchicalCopyAllReduce()), under which it runs."
        )


class _ReductionSkip(threading.local):
    reductions_skipped: int = 0


_SKIP_LOCK = threading.Lock()
_SKIP_USERS: dict = {}  # id(optimizer) -> [optimizer, number of users]
_skip_seen = _ReductionSkip()


def _skipped_reduction(grads_and_vars: Any) -> list:
    _skip_seen.reductions_skipped += 1
    return list(grads_and_vars)


def _optimizers_within(optimizer: Any) -> list:
    """`optimizer` and the optimizers it delegates to (a `MultiOptimizer`'s
    sub-optimizers), found among its attributes."""
    found, pending = [], [optimizer]
    while pending:
        candidate = pending.pop()
        if any(candidate is f for f in found):
            continue
        found.append(candidate)
        for value in vars(candidate).values():
            items = value if isinstance(value, (list, tuple)) else (value,)
            pending.extend(
                item
                for item in items
                if isinstance(item, keras.optimizers.Optimizer)
            )
    return found


@contextlib.contextmanager
def _inner_reduction_skipped(optimizer: Any) -> Iterator[None]:
    """While tracing the inner optimizer's `apply`: gradients given to it are
    already summed over replicas, so it must not all-reduce them again.

    Keras 3 (TensorFlow backend, read in 3.10-3.15) all-reduces them in the
    private `TFOptimizer._all_reduce_sum_gradients`, with no public switch
    (tf_keras has `apply_gradients(skip_gradients_aggregation=True)`). It
    is shadowed by an identity on the instance (and on the sub-optimizers a
    `MultiOptimizer` delegates to) for the duration of the trace. Replica
    threads of a `MirroredStrategy` trace concurrently: the shadow stays
    while any of them is inside. A trace that never reached the shadow
    (Keras reduces elsewhere) is an error, not a silent double sum.
    """
    targets = _optimizers_within(optimizer)
    for target in targets:
        if not hasattr(target, "_all_reduce_sum_gradients"):
            raise RuntimeError(
                f"Keras {keras.version()} has no "
                "`Optimizer._all_reduce_sum_gradients`: "
                "GradientAccumulationOptimizer cannot keep "
                f"{type(target).__name__} from all-reducing gradients that "
                "are already reduced (gradient compression, or clipping "
                "under several replicas). Read in Keras 3.10-3.15."
            )
    with _SKIP_LOCK:
        for target in targets:
            entry = _SKIP_USERS.setdefault(id(target), [target, 0])
            if entry[1] == 0:
                vars(target)["_all_reduce_sum_gradients"] = _skipped_reduction
            entry[1] += 1
    before = _skip_seen.reductions_skipped
    try:
        yield
    finally:
        with _SKIP_LOCK:
            for target in targets:
                entry = _SKIP_USERS[id(target)]
                entry[1] -= 1
                if entry[1] == 0:
                    vars(target).pop("_all_reduce_sum_gradients", None)
                    del _SKIP_USERS[id(target)]
    if _skip_seen.reductions_skipped == before:
        raise RuntimeError(
            f"The inner optimizer {type(optimizer).__name__} applied "
            "gradients without going through Keras's "
            "`_all_reduce_sum_gradients`; GradientAccumulationOptimizer "
            "cannot tell whether it reduced them a second time. Gradient "
            "compression and clipping under several replicas support "
            "Keras's own optimizers (and MultiOptimizer) only."
        )


def _replica_share(context: Any, grad: Any) -> Any:
    """This replica's part of an all-reduced gradient, such that the
    inner optimizer's all-reduce (a sum) gives `grad` back: an equal share
    of a dense gradient; all rows of a sparse one on the first replica and
    none elsewhere, so each row reaches the inner optimizer once."""
    replicas = context.num_replicas_in_sync
    if not is_sparse(grad):
        return grad / replicas
    if replicas == 1:
        return grad
    first = tf.equal(context.replica_id_in_sync_group, 0)
    rows = tf.where(first, tf.shape(grad.indices)[0], 0)
    return tf.IndexedSlices(
        grad.values[:rows], grad.indices[:rows], grad.dense_shape
    )


def _slot_kind(grad: Any, variable: Any) -> str:
    if overwrites_with_gradient(variable):
        return MAXIMUM
    if is_sparse(grad):
        return SPARSE
    return DENSE

"""The window's state and math behind `use_window_statistics(...,
statistics="window")`: the accumulators a switched BatchNormalization keeps
(calls, count, mean, M2), how one micro-batch advances them (Chan et al.'s
pairwise update, across replicas), the ops they are written against
(`keras.ops`, or TensorFlow's for tf_keras) and the private Keras hooks they
need, each isolated in one function. The layer class and the whole-model
switch are in `window_statistics`."""

from __future__ import annotations

import contextlib
import functools
import types
from typing import Any

from keras_mgpu._flavour import (
    TF_RUNS,
    flavour_of,
    tf,
)
from keras_mgpu.normalization._find import (
    STATISTICS_ATTR,
)

STATISTICS = ("window", "momentum")

# Instance attributes of a switched layer (set with object.__setattr__: no
# flavour tracks them, `get_config` never sees them).
_WINDOW = "_keras_mgpu_window"
_STATISTICS = STATISTICS_ATTR
_USER_MOMENTUM = "_keras_mgpu_user_momentum"
_STATE = "_keras_mgpu_window_state"
_ORIGINAL_CLASS = "_keras_mgpu_original_class"

# The accumulators of a window, in creation (and therefore saving) order:
# micro-batch calls so far, examples seen per channel, their mean, and the
# sum of squared deviations from it (Chan et al.'s pairwise update).
_STATE_NAMES = ("window_calls", "window_count", "window_mean", "window_m2")


# ---------------------------------------------------------------------------
# Private Keras hooks, each isolated in one function.
# ---------------------------------------------------------------------------


def _in_symbolic_build() -> bool:
    """Keras 3.15 runs `call` on placeholders to infer shapes; nothing is
    trained there (see `_recompute_engine.in_symbolic_build`)."""
    from keras_mgpu.layers._recompute_engine import in_symbolic_build

    return in_symbolic_build()


def _current_training() -> Any:
    from keras_mgpu.layers._recompute_engine import current_training

    return current_training()


@contextlib.contextmanager
def _unlocked(layer: Any):
    """Keras 3.15 locks a layer's tracker after `build` (`Layer._tracker`,
    private); Keras's own `quantize` unlocks it the same way to add state to
    a built layer. tf_keras has no lock."""
    tracker = getattr(layer, "_tracker", None)
    locked = bool(getattr(tracker, "locked", False))
    if locked:
        tracker.unlock()
    try:
        yield
    finally:
        if locked:
            tracker.lock()


def _untrack(layer: Any, variables: list) -> None:
    """Forget `variables` as state of `layer`, so its weights, checkpoints
    and `.keras` files are the plain layer's again.

    Keras 3.15: `Layer._untrack_variable` (private). tf_keras 2.21: the
    `_non_trainable_weights` list and the trackable's named checkpoint
    dependencies (`tensorflow/python/trackable/base.py`, private).
    """
    if hasattr(layer, "_untrack_variable") and hasattr(layer, "_tracker"):
        for variable in variables:
            layer._untrack_variable(variable)
        return
    ids = {id(v) for v in variables}
    layer._non_trainable_weights[:] = [
        w for w in layer._non_trainable_weights if id(w) not in ids
    ]
    deps = getattr(layer, "_self_unconditional_checkpoint_dependencies", None)
    names = getattr(layer, "_self_unconditional_dependency_names", None)
    if deps is not None and names is not None:
        deps[:] = [d for d in deps if id(d.ref) not in ids]
        for name in [n for n, ref in names.items() if id(ref) in ids]:
            del names[name]


def _tf_variable(variable: Any) -> Any:
    # A Keras 3 variable wraps a tf.Variable (`.value`); tf_keras's is one.
    inner = getattr(variable, "value", None)
    return inner if isinstance(inner, tf.Variable) else variable


def _strategy_scope_of(variable: Any):
    """Enter the strategy `variable` was made under (new state must be
    distributed like the moving statistics), unless already inside it.
    Nothing to enter where TensorFlow does not run (on JAX the new state
    takes the moving statistics' layout: `backend.jax.variables`)."""
    if not TF_RUNS:
        return contextlib.nullcontext()
    strategy = getattr(_tf_variable(variable), "distribute_strategy", None)
    if not isinstance(strategy, tf.distribute.Strategy):
        return contextlib.nullcontext()
    if tf.distribute.has_strategy() and (
        tf.distribute.get_strategy() is strategy
    ):
        return contextlib.nullcontext()
    return strategy.scope()


# ---------------------------------------------------------------------------
# The ops the window's math is written against: `keras.ops` for Keras 3 on
# any backend; TensorFlow's own for tf_keras (a tf_keras process does not
# load Keras 3).
# ---------------------------------------------------------------------------


@functools.cache
def _tensorflow_ops() -> Any:
    """The `keras.ops` names the window's math uses, for tf_keras: one
    table naming TensorFlow's op for each (built on first use, so a process
    where TensorFlow does not run never touches it)."""
    return types.SimpleNamespace(
        convert_to_tensor=tf.convert_to_tensor,
        copy=tf.identity,
        size=tf.size,
        cast=tf.cast,
        sum=tf.reduce_sum,
        maximum=tf.maximum,
        square=tf.square,
        where=tf.where,
        logical_and=tf.logical_and,
        ones_like=tf.ones_like,
        zeros_like=tf.zeros_like,
    )


def _ops_of(layer: Any) -> Any:
    if flavour_of(layer) == "tf_keras":
        return _tensorflow_ops()
    import keras as keras3

    return keras3.ops


def _dtype_name(dtype: Any) -> str:
    # A string (Keras 3 variables), a tf.DType or a NumPy dtype (JAX arrays).
    return dtype if isinstance(dtype, str) else dtype.name


def _static_bool(value: Any) -> Any:
    """`value` as a Python bool when it is known before the step runs, else
    None (a symbolic tensor or a JAX tracer)."""
    if TF_RUNS and tf.is_tensor(value):
        static = tf.get_static_value(value)
        return None if static is None else bool(static)
    try:
        return bool(value)
    except Exception:  # noqa: BLE001 - a tracer cannot be a Python bool
        return None


def _check_statistics(statistics: Any) -> None:
    if statistics not in STATISTICS:
        raise ValueError(
            f"Argument `statistics` must be one of {STATISTICS}. Received: "
            f"statistics={statistics!r}"
        )


def _set_mode(layer: Any, window: int, statistics: str) -> None:
    object.__setattr__(layer, _WINDOW, window)
    object.__setattr__(layer, _STATISTICS, statistics)


def _training_value(layer: Any, training: Any) -> Any:
    """True, False, or a boolean tensor: whether this call updates the
    moving statistics (both flavours: `training` and `layer.trainable`)."""
    if not layer.trainable:
        return False
    if training is None:
        training = _current_training()
    if training is None:
        return False
    static = _static_bool(training)
    if static is not None:
        return static
    return _ops_of(layer).cast(training, "bool")


def _count(layer: Any, inputs: Any, mask: Any, channels: Any) -> Any:
    """Examples per channel the layer's statistics were taken over."""
    ops = _ops_of(layer)
    size = ops.cast(ops.size(inputs), "float32")
    # tf_keras's fused kernel ignores the mask (and says so).
    if mask is None or getattr(layer, "fused", False):
        return size / channels
    weights = ops.cast(mask, "float32")
    # Both flavours broadcast the mask over the channel axis.
    return (
        ops.sum(weights)
        * size
        / (ops.cast(ops.size(weights), "float32") * channels)
    )


def _global_count(layer: Any, mask: Any, n: Any) -> Any:
    """`n` summed over the replicas of the `tf.distribute` strategy when
    `layer` synchronises its statistics for this call; `n` otherwise.

    Keras 3 synchronises unmasked moments only (its masked moments are
    local); tf_keras's `_sync_calculate_mean_and_var` both. On JAX the
    jitted step is the global program: `n` is the global count already.
    """
    if not TF_RUNS or not getattr(layer, "synchronized", False):
        return n
    if mask is not None and flavour_of(layer) == "keras3":
        return n
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return n
    return context.all_reduce(tf.distribute.ReduceOp.SUM, n)


def _bessel(ops: Any, n: Any, inverse: bool = False) -> Any:
    """n / (n - 1) (or its inverse); 1 where n <= 1."""
    safe = ops.maximum(n, 2.0)
    factor = (safe - 1.0) / safe if inverse else safe / (safe - 1.0)
    return ops.where(n > 1.0, factor, ops.ones_like(factor))


def _advance_window(layer, state, inputs, mask, old_mean, old_var, active):
    """Fold this call's statistics into the window; at its last call, move
    the moving statistics once, with the window's statistics; otherwise put
    them back as they were."""
    ops = _ops_of(layer)
    calls_v, count_v, mean_v, m2_v = state
    dtype = _dtype_name(old_mean.dtype)
    momentum = float(layer.momentum)
    new_mean = ops.convert_to_tensor(layer.moving_mean)
    new_var = ops.convert_to_tensor(layer.moving_variance)
    # Keras moved each statistic by (1 - momentum) towards the
    # micro-batch's; undo that to read the micro-batch's mean and biased
    # variance. The rounding this amplifies by 1 / (1 - momentum) is scaled
    # back by (1 - momentum) in the window's update.
    decay = 1.0 - momentum
    batch_mean = (new_mean - momentum * old_mean) / decay
    batch_var = (new_var - momentum * old_var) / decay
    channels = ops.cast(ops.size(old_mean), "float32")
    n = ops.cast(_count(layer, inputs, mask, channels), dtype)
    # Synchronised statistics are the global micro-batch's: weigh them by
    # its size, not by this replica's share (they differ per replica when
    # a batch does not split evenly).
    n = _global_count(layer, mask, n)

    # tf_keras's fused kernel (4-D and 5-D inputs) moves the variance
    # towards the micro-batch's unbiased variance (measured with TF 2.21 in
    # eager, tf.function and XLA alike): work in biased variances and give
    # the window's the same correction, as its large batch would.
    bessel = bool(getattr(layer, "fused", False))
    if bessel:
        batch_var = batch_var * _bessel(ops, n, inverse=True)

    calls = ops.convert_to_tensor(calls_v)
    count = ops.convert_to_tensor(count_v)
    mean = ops.convert_to_tensor(mean_v)
    m2 = ops.convert_to_tensor(m2_v)
    # Pairwise merge of (count, mean, M2): exact for any micro-batch sizes
    # and free of the cancellation of E[x^2] - E[x]^2.
    total = count + n
    safe_total = ops.maximum(total, ops.ones_like(total))
    delta = batch_mean - mean
    merged_mean = mean + delta * (n / safe_total)
    merged_m2 = (
        m2 + batch_var * n + ops.square(delta) * (count * n / safe_total)
    )
    calls = calls + 1.0
    last = calls >= float(layer.__dict__[_WINDOW])
    moves = ops.logical_and(last, total > 0)
    window_var = merged_m2 / safe_total
    if bessel:
        window_var = window_var * _bessel(ops, total)
    moved_mean = old_mean * momentum + merged_mean * decay
    moved_var = old_var * momentum + window_var * decay

    def pick(condition, a, b):
        return ops.where(condition, a, b)

    updates = [
        (layer.moving_mean, pick(moves, moved_mean, old_mean), new_mean),
        (layer.moving_variance, pick(moves, moved_var, old_var), new_var),
        (calls_v, pick(last, ops.zeros_like(calls), calls), calls_v),
        (count_v, pick(last, ops.zeros_like(total), total), count_v),
        (mean_v, pick(last, ops.zeros_like(mean), merged_mean), mean_v),
        (m2_v, pick(last, ops.zeros_like(m2), merged_m2), m2_v),
    ]
    for variable, value, unchanged in updates:
        if active is not True:
            # `training` is a tensor: leave everything as the class's
            # `call` left it when it is False.
            value = ops.where(active, value, ops.convert_to_tensor(unchanged))
        variable.assign(value)


def _ensure_state(layer: Any) -> None:
    """Create the window's accumulators once the layer is built."""
    if layer.__dict__.get(_STATISTICS) != "window":
        return
    if layer.__dict__.get(_STATE) is not None:
        return
    moving_mean = getattr(layer, "moving_mean", None)
    if moving_mean is None:
        return  # Not built yet: `build` comes back here.
    flavour = flavour_of(layer)
    dtype = _dtype_name(moving_mean.dtype)
    shapes = ((), (), tuple(moving_mean.shape), tuple(moving_mean.shape))
    state = []
    # tf_keras names variables after the name scope at creation (its build
    # runs under the layer's); Keras 3 gives them the layer's path itself.
    scope = (
        tf.name_scope(layer.name + "/")
        if flavour == "tf_keras"
        else contextlib.nullcontext()
    )
    with _strategy_scope_of(moving_mean), _unlocked(layer), scope:
        for name, shape in zip(_STATE_NAMES, shapes, strict=True):
            if flavour == "tf_keras":
                # Distributed like tf_keras's moving statistics.
                variable = layer.add_weight(
                    name=name,
                    shape=shape,
                    dtype=tf.as_dtype(dtype),
                    initializer="zeros",
                    trainable=False,
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.MEAN,
                    experimental_autocast=False,
                )
            else:
                # Distributed like Keras 3's moving statistics (aggregation
                # "none": under MirroredStrategy each replica updates its own
                # copy in replica context, as BatchNormalization does).
                variable = layer.add_weight(
                    name=name,
                    shape=shape,
                    dtype=dtype,
                    initializer="zeros",
                    trainable=False,
                    autocast=False,
                )
            state.append(variable)
    if flavour == "keras3" and not TF_RUNS:
        from keras_mgpu.backend.jax.variables import place_like

        for variable in state:
            place_like(variable, moving_mean)
    object.__setattr__(layer, _STATE, tuple(state))


def window_state(layer: Any) -> tuple:
    """The accumulators of a layer switched with `statistics="window"`
    (calls, count, mean, M2), or () for any other layer."""
    return tuple(layer.__dict__.get(_STATE) or ())

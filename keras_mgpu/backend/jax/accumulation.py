"""Gradient accumulation on Keras's JAX backend (`keras.distribution`).

`GradientAccumulationOptimizer.apply` comes here on JAX. It runs wherever
Keras runs an optimizer there: inside the `StatelessScope` of
`stateless_apply` (the jitted `fit` step, or a custom loop built on
`model.stateless_call` + `jax.grad` + `optimizer.stateless_apply`), or
eagerly on concrete arrays. Everything it reads or writes is one of the
wrapper's `variables` (its counters and accumulators, then the inner
optimizer's variables), so the stateless scope maps all of it.

One micro-step:
- `pending = pending_steps + 1`; the window is complete when it reaches
  `accumulation_steps`;
- `ops.cond(complete, update, hold)` (`jax.lax.cond`: both branches are
  traced, one runs):
  - `hold` adds the gradients to the accumulators and returns every other
    value unchanged;
  - `update` takes the mean of the window (accumulators plus this
    micro-step's gradients, over `accumulation_steps`), and, if it is
    finite, hands it to the inner optimizer's `stateless_apply`; the inner
    optimizer's `iterations`, learning-rate schedule, clipping, weight
    decay and EMA therefore advance only here, once per update (with
    `momentum_correction`, the SGD velocity is rescaled here first). A
    non-finite mean skips the window (`skipped_updates`). The accumulators
    restart from zero.

Under a distribution the gradients a step hands the optimizer are global
values (the jitted step is one program over the mesh), so the mean here is
already the mean over the `K·R` micro-batches, and clipping sees it whole.

With `reduction="per_update"` the accumulators have a leading axis of one
row per device (sharded over the data axis); the per-device train step of
`keras_mgpu/backend/jax/reduction.py` hands gradients in that form, and
the update sums the rows (the window's one all-reduce) before dividing by
`K·R`: the inner optimizer then sees the same global mean.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops


def _all_finite(values: list) -> Any:
    flags = [ops.all(ops.isfinite(v)) for v in values]
    if not flags:
        return ops.convert_to_tensor(True)
    return ops.all(ops.stack(flags))


def apply_accumulation(
    optimizer: Any, grads: list, trainable_variables: list, maximum: list
) -> None:
    """One micro-step of `optimizer` (a `GradientAccumulationOptimizer`).

    `grads` and `trainable_variables` are aligned and without `None`
    gradients; the optimizer is built. `maximum[i]` says whether Keras
    overwrites variable `i` with its "gradient" (float8 scales and amax
    histories: the window's maximum is kept instead of a mean); the
    optimizer passes it in, so this backend module imports no feature.
    """
    inner = optimizer.inner_optimizer
    steps = optimizer.accumulation_steps
    indices = [optimizer._get_variable_index(v) for v in trainable_variables]
    accumulators = [optimizer._accumulators[i] for i in indices]
    scale = optimizer.loss_scale_factor

    grads = [
        _unscaled(ops.cast(g, a.dtype), scale, is_max)
        for g, a, is_max in zip(grads, accumulators, maximum)
    ]
    # With `reduction="per_update"` each accumulator has a leading axis of
    # `devices` rows (one per device, sharded over the data axis).
    devices = optimizer._per_device_rows
    if devices:
        grads = [_per_device(g, a) for g, a in zip(grads, accumulators)]
    accumulated = [a.value for a in accumulators]
    model_variables = list(inner._trainable_variables)
    model_values = [v.value for v in model_variables]
    inner_values = [v.value for v in inner.variables]
    correcting = bool(optimizer.momentum_correction)
    if correcting:
        previous = optimizer._previous_learning_rate.value
    else:  # a placeholder, so that both branches return the same structure
        previous = ops.zeros((), dtype="float32")
    pending = ops.add(optimizer._pending_steps.value, 1)
    complete = ops.greater_equal(pending, steps)

    def totals() -> list:
        return [
            ops.maximum(a, g) if is_max else ops.add(a, g)
            for a, g, is_max in zip(accumulated, grads, maximum)
        ]

    following = _averages_of(inner)

    def hold():
        held = _follow_weights(following, inner_values, model_values)
        return model_values, held, totals(), _zero_int(), previous

    def update():
        window = totals()
        if devices:
            # The update's one cross-device reduction: the rows of each
            # device are summed (a window's maximum: the maximum over them).
            window = [
                ops.max(t, axis=0) if is_max else ops.sum(t, axis=0)
                for t, is_max in zip(window, maximum)
            ]
        divisor = steps * (devices or 1)
        means = [
            t if is_max else ops.divide(t, divisor)
            for t, is_max in zip(window, maximum)
        ]
        # The inner optimizer is built on the same variables, in the same
        # order; a variable without a gradient gets None, as it would
        # without accumulation.
        inner_grads: list = [None] * len(model_variables)
        for index, mean in zip(indices, means):
            inner_grads[index] = mean

        def apply_mean():
            values, rate = inner_values, previous
            if correcting:
                values, rate = _correct_momentum(inner, inner_values, previous)
            new_model, new_inner = inner.stateless_apply(
                values, inner_grads, model_values
            )
            return list(new_model), list(new_inner), _zero_int(), rate

        def skip():
            return model_values, inner_values, _one_int(), previous

        new_model, new_inner, skipped, rate = ops.cond(
            _all_finite(means), apply_mean, skip
        )
        zeros = [ops.zeros_like(a) for a in accumulated]
        return new_model, new_inner, zeros, skipped, rate

    new_model, new_inner, new_accumulated, skipped, rate = ops.cond(
        complete, update, hold
    )
    if correcting:
        optimizer._previous_learning_rate.assign(rate)
    for variable, value in zip(model_variables, new_model):
        variable.assign(value)
    for variable, value in zip(inner.variables, new_inner):
        variable.assign(value)
    for variable, value in zip(accumulators, new_accumulated):
        variable.assign(value)
    optimizer._skipped_updates.assign_add(
        ops.cast(skipped, optimizer._skipped_updates.dtype)
    )
    optimizer._pending_steps.assign(
        ops.where(complete, ops.zeros_like(pending), pending)
    )
    optimizer._iterations.assign_add(1)


def _averages_of(inner: Any) -> list:
    """(position in `inner.variables`, position in its trainable variables)
    of each EMA average, and the position of its update counter last; empty
    without EMA."""
    if not inner.use_ema:
        return []
    positions = {id(v): i for i, v in enumerate(inner.variables)}
    pairs = [
        (positions[id(average)], index)
        for index, average in enumerate(inner._model_variables_moving_average)
        if average is not None
    ]
    return pairs + [(positions[id(inner._iterations)], None)] if pairs else []


def _follow_weights(following: list, inner_values: list, model: list) -> list:
    """Before the inner optimizer's first update, each EMA average takes its
    weight (Keras starts them at zero, and `fit`'s end or `SwapEMAWeights`
    would put those zeros into the model); after it, nothing changes. A
    `cond` on the update counter, so later micro-steps copy nothing."""
    if not following:
        return inner_values
    *pairs, (counter, _) = following

    def weights() -> list:
        return [
            ops.cast(model[index], inner_values[position].dtype)
            for position, index in pairs
        ]

    def averages() -> list:
        return [inner_values[position] for position, _ in pairs]

    new = ops.cond(ops.equal(inner_values[counter], 0), weights, averages)
    values = list(inner_values)
    for (position, _), value in zip(pairs, new):
        values[position] = value
    return values


def _correct_momentum(inner: Any, inner_values: list, previous: Any) -> tuple:
    """Momentum correction (Goyal et al., 2017), as on TensorFlow: scale
    the SGD velocity by `rate / previous_rate` before the update, so that
    the step equals the rate-free form `u = m*u + g; w -= rate*u`. Returns
    the inner optimizer's values with the velocities scaled, and the rate
    of this update (evaluated as the inner optimizer will, at its update
    count). The first update (previous rate 0) is left alone."""
    mapping = list(zip(inner.variables, inner_values))
    with keras.StatelessScope(state_mapping=mapping):
        rate = ops.cast(inner._get_current_learning_rate(), "float32")
    ratio = ops.where(
        ops.greater(previous, 0.0),
        ops.divide(rate, ops.where(ops.greater(previous, 0.0), previous, 1.0)),
        1.0,
    )
    positions = {id(v): i for i, v in enumerate(inner.variables)}
    values = list(inner_values)
    for velocity in getattr(inner, "momentums", None) or ():
        if velocity is None:
            continue
        index = positions[id(velocity)]
        values[index] = values[index] * ops.cast(ratio, values[index].dtype)
    return values, rate


def _per_device(grad: Any, accumulator: Any) -> Any:
    """A gradient in the per-device accumulators' form `(R, *shape)`.

    One taken per device (the per-update train step) already has it: each
    row is a device's gradient of its shard's mean loss, so the rows' mean
    is the global batch's gradient. One of the global batch (Keras's own
    step, a custom loop, `apply` on concrete arrays) is therefore copied
    into every row (the rows' mean is then itself; no communication).
    """
    if len(grad.shape) == len(accumulator.shape):
        return grad
    return ops.broadcast_to(ops.expand_dims(grad, 0), accumulator.shape)


def _unscaled(grad: Any, scale: Any, is_max: bool) -> Any:
    # Variables Keras overwrites with their "gradient" (float8 scales and
    # amax histories) are neither loss-scaled nor averaged.
    if scale is None or is_max:
        return grad
    return ops.divide(grad, scale)


def _zero_int() -> Any:
    return ops.convert_to_tensor(0, dtype="int32")


def _one_int() -> Any:
    return ops.convert_to_tensor(1, dtype="int32")

"""What the Keras 3 and tf_keras gradient-accumulation wrappers share.

The two flavours' optimizer base classes differ (Keras 3 `apply` and
`keras.Variable`s, tf_keras `apply_gradients` and `tf.Variable`s), but the
accumulation protocol under `tf.distribute` is one: count the micro-step,
decide in cross-replica context whether the window is complete, and re-enter
the replicas to hand the mean gradient to the inner optimizer once. That
protocol, the counters, the argument checks, the sparse-gradient helpers and
the optimizer API both flavours pass through to the inner optimizer live here;
each flavour module supplies `_decide`, `_apply_to_inner` and `_reset`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from keras_mgpu import compression as compression_lib
from keras_mgpu._flavour import TF_RUNS, flavour_of, keras, keras_of, tf
from keras_mgpu._validation import check_bool, check_int
from keras_mgpu.compression.reduce import (
    all_reduce_sum as all_reduce_sum_by_dtype,
)

# Base-optimizer arguments both flavours' wrappers refuse: they belong on the
# inner optimizer, which applies them once per real update.
INNER_ONLY_ARGUMENTS = (
    "learning_rate",
    "weight_decay",
    "clipnorm",
    "global_clipnorm",
    "clipvalue",
    "use_ema",
    "ema_momentum",
    "ema_overwrite_frequency",
)


# How a micro-step's gradient for one variable is accumulated, and what the
# inner optimizer receives at the end of the window.
DENSE = "dense"  # summed; the inner gets the mean as a dense tensor
SPARSE = "sparse"  # summed; the inner gets the touched rows' mean (slices)
MAXIMUM = "maximum"  # `overwrite_with_gradient`: the window's maximum


class AccumulatorSlot(NamedTuple):
    """One trainable variable, its accumulator, how it accumulates, and the
    state variables its gradient compression keeps (if any)."""

    variable: Any
    accumulator: Any
    kind: str
    state: tuple = ()


def all_finite(tensors: list) -> tf.Tensor:
    """A scalar bool: every element of every tensor is finite."""
    flags = [
        tf.reduce_all(tf.math.is_finite(_values(t)))
        for t in tensors
        if t is not None
    ]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


def _values(tensor: Any) -> Any:
    return tensor.values if isinstance(tensor, tf.IndexedSlices) else tensor


def variable_name(variable: Any) -> str:
    """A Keras variable's `path`, or a raw `tf.Variable`'s name."""
    path = getattr(variable, "path", None)
    return path if path is not None else variable.name.split(":")[0]


def overwrites_with_gradient(variable: Any) -> bool:
    """Whether Keras overwrites `variable` with its gradient (float8 scales
    and amax histories) instead of applying an update."""
    return bool(getattr(variable, "overwrite_with_gradient", False))


def scatter_add_locally(variable: tf.Variable, slices: tf.IndexedSlices):
    """Add `slices` to `variable` in replica context, touching only its rows.

    TensorFlow (2.16-2.21) refuses `scatter_add` on an `ON_READ` variable
    ("doesn't support `scatter_add`") although it allows `assign_add`, which
    updates this replica's own copy. Its private
    `_get_on_device_or_primary()` returns that copy, on which the scatter is
    the same local write. Variables that are not per-replica (no strategy,
    CentralStorageStrategy's aggregating variable) take the scatter directly.
    """
    if isinstance(variable, tf.distribute.DistributedValues):
        variable = variable._get_on_device_or_primary()
    return variable.scatter_add(slices)


def touched_rows(total: tf.Tensor, divisor: Any) -> tf.IndexedSlices:
    """The rows of an accumulated sparse gradient that received any gradient,
    divided by `divisor`, as `tf.IndexedSlices` with unique indices.

    A row counts as touched when any element is non-zero (NaN included, so
    a non-finite window stays visible). A touched row whose contributions
    cancel to exactly zero is left out; every optimizer whose sparse update
    equals its dense one (what Keras's `optimizer_sparse_test` checks) treats
    a zero row and a missing row alike.
    """
    axes = list(range(1, total.shape.rank))
    touched = tf.not_equal(total, tf.zeros_like(total))
    if axes:
        touched = tf.reduce_any(touched, axis=axes)
    rows = tf.where(touched)[:, 0]
    return tf.IndexedSlices(
        tf.gather(total, rows) / divisor,
        rows,
        dense_shape=tf.shape(total, out_type=tf.int64),
    )


def deduplicate_rows(slices: tf.IndexedSlices) -> tf.IndexedSlices:
    """Sum the values of repeated indices (an all-reduce of slices from
    several replicas concatenates them), so norms are the dense gradient's."""
    unique, positions = tf.unique(slices.indices)
    values = tf.math.unsorted_segment_sum(
        slices.values, positions, tf.shape(unique)[0]
    )
    return tf.IndexedSlices(values, unique, slices.dense_shape)


def divide_gradient(gradient: Any, divisor: Any) -> Any:
    """`gradient / divisor` for a dense tensor or `tf.IndexedSlices`."""
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            gradient.values / divisor, gradient.indices, gradient.dense_shape
        )
    return gradient / divisor


def is_sparse(gradient: Any) -> bool:
    return isinstance(gradient, tf.IndexedSlices)


def all_reduce_sum(context: Any, grads: list) -> list:
    """Sum `grads` over the replicas (replica context); repeated rows of
    sparse gradients, which the sum concatenates, are summed too."""
    reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
    if context.num_replicas_in_sync == 1:
        return reduced
    return [deduplicate_rows(g) if is_sparse(g) else g for g in reduced]


# ----------------------------------------------------------------------
# Gradient compression (keras_mgpu.compression)
# ----------------------------------------------------------------------
_NOT_ALL_REDUCING = ("central_storage", "parameter_server")


def check_compression(compression: Any, strategy: Any) -> Any:
    """The compression method `compression` names, checked against the
    strategy the optimizer is created under."""
    from keras_mgpu.distribute.strategy import strategy_kind

    method = compression_lib.get(compression)
    kind = strategy_kind(strategy)
    if method is not None and kind in _NOT_ALL_REDUCING:
        raise ValueError(
            f"Argument `compression={compression!r}` needs a strategy that "
            f"all-reduces gradients between replicas, but the optimizer is "
            f"created under {type(strategy).__name__}, which sends every "
            "gradient to the parameter devices instead (there the "
            "accumulators themselves live on the parameter devices). Use "
            "MirroredStrategy or MultiWorkerMirroredStrategy, or "
            "compression=None."
        )
    return method


def reduce_before_the_inner(
    context: Any, grads: list, slots: list, compression: Any
) -> tuple:
    """Replica context: all-reduce the window's mean gradient here, once,
    and give every replica the whole of it.

    `grads` are this replica's shares (they sum over replicas to the mean).
    Dense ones cross devices through `compression` (float32 when it is
    None); sparse ones (`tf.IndexedSlices`, a row count known only at run
    time) always cross as they are, their repeated rows summed. The inner
    optimizer must then not reduce again.

    Returns `(finite, means, state_values)`: whether the reduced mean (and
    the method's side information) is finite, identical on every replica
    because it is computed from all-reduced values; the means; for each
    slot, the new values of its compression state (empty when unchanged).
    """
    means: list = [None] * len(grads)
    state_values: list = [()] * len(grads)
    sparse = [i for i, g in enumerate(grads) if is_sparse(g)]
    dense = [i for i, g in enumerate(grads) if not is_sparse(g)]
    if sparse:
        reduced = all_reduce_sum(context, [grads[i] for i in sparse])
        for i, grad in zip(sparse, reduced):
            means[i] = grad
    finite = tf.constant(True)
    if dense and compression is None:
        reduced = all_reduce_sum_by_dtype(context, [grads[i] for i in dense])
        for i, grad in zip(dense, reduced):
            means[i] = grad
    elif dense:
        reduction = compression.all_reduce(
            context, [grads[i] for i in dense], [slots[i].state for i in dense]
        )
        finite = reduction.finite
        for i, mean, values in zip(
            dense, reduction.means, reduction.state_values
        ):
            means[i] = mean
            state_values[i] = values
    return tf.logical_and(finite, all_finite(means)), means, state_values


def assign_compression_state(slots: list, state_values: list) -> None:
    """Write the compression state computed for an applied update (replica
    context: each replica writes its own copy)."""
    for slot, values in zip(slots, state_values):
        for variable, value in zip(slot.state if values else (), values):
            variable.assign(value)


def reject_wrapper_arguments(kwargs: dict, inner_only: tuple) -> None:
    """Raise for base-optimizer arguments given to the wrapper.

    They belong on the inner optimizer, which applies them once per update.
    """
    for argument in inner_only:
        if argument in kwargs:
            raise ValueError(
                f"GradientAccumulationOptimizer does not take "
                f"`{argument}`. Received: {argument}="
                f"{kwargs[argument]!r}. Set `{argument}` on the "
                "`inner_optimizer` instead."
            )
    if kwargs:
        raise TypeError(
            "GradientAccumulationOptimizer got unexpected arguments: "
            f"{', '.join(sorted(kwargs))}."
        )


def check_inner_is_not_a_wrapper(
    inner_optimizer: Any, wrapper_class: type, loss_scale_class: type
) -> None:
    """Reject wrapping twice and a loss-scale optimizer inside the wrapper."""
    if isinstance(inner_optimizer, wrapper_class):
        raise ValueError(
            "Argument `inner_optimizer` is already a "
            "GradientAccumulationOptimizer (accumulation_steps="
            f"{inner_optimizer.accumulation_steps}). Wrapping twice "
            "would accumulate twice: use a single wrapper with "
            "accumulation_steps set to the product."
        )
    if isinstance(inner_optimizer, loss_scale_class):
        raise ValueError(
            "Argument `inner_optimizer` is a LossScaleOptimizer. Put "
            "loss scaling outside: LossScaleOptimizer("
            "GradientAccumulationOptimizer(inner, accumulation_steps)). "
            "`model.compile` does that for you under the "
            "'mixed_float16' policy."
        )


def check_momentum_correction(
    momentum_correction: Any, inner_optimizer: Any
) -> bool:
    """Validate `momentum_correction` against the inner optimizer."""
    check_bool(momentum_correction, "momentum_correction")
    if not momentum_correction:
        return False
    momentum = getattr(inner_optimizer, "momentum", 0.0)
    sgd = keras_of(flavour_of(inner_optimizer)).optimizers.SGD
    if not isinstance(inner_optimizer, sgd) or not momentum:
        raise ValueError(
            "Argument `momentum_correction=True` needs an SGD inner optimizer "
            "with momentum > 0: Keras's SGD keeps the learning rate inside "
            "its velocity, which the correction rescales when the rate "
            "changes. Other optimizers apply the rate after their moment "
            "estimates and need no correction. Received: inner_optimizer="
            f"{type(inner_optimizer).__name__}"
            + (
                f"(momentum={momentum})"
                if hasattr(inner_optimizer, "momentum")
                else ""
            )
        )
    return True


def _made_no_update(optimizer: Any) -> bool:
    """Whether `optimizer` keeps EMA averages and has, as far as can be
    read now, made no update (its `iterations` is a concrete 0). Inside a
    traced function the count is unknown: False, and the averages, which
    follow the weights until the first update, are used."""
    if not getattr(optimizer, "use_ema", False):
        return False
    if TF_RUNS:
        if not tf.executing_eagerly():
            return False
        # A distributed variable (tf_keras under a strategy) has no
        # `__array__`; converted, it reads as its primary copy.
        return int(tf.convert_to_tensor(optimizer.iterations).numpy()) == 0
    try:
        return int(np.asarray(optimizer.iterations)) == 0
    except TypeError:  # a JAX tracer: inside a jitted function
        return False


def _inner_setting(name: str) -> property:
    """A base-optimizer setting read from (and written to) the inner
    optimizer, which applies it once per update.

    The base class's `__init__` assigns the wrapper's own (unset) value
    before `inner_optimizer` exists; that assignment is dropped.
    """

    def getter(self) -> Any:
        inner = self.__dict__.get("inner_optimizer")
        return None if inner is None else getattr(inner, name)

    def setter(self, value: Any) -> None:
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None:
            setattr(inner, name, value)

    return property(getter, setter, doc=f"The inner optimizer's `{name}`.")


# The `GradientAccumulationOptimizer` class for an inner optimizer's flavour
# (None for neither), installed by the package, `keras_mgpu/optimizers/
# __init__.py`, which imports the flavour modules lazily: this module, below
# both flavours, does not import its package (no import circle).
_flavour_lookup: list = [lambda inner_optimizer: None]


def install_flavour_lookup(lookup: Any) -> None:
    """Install the package's `lookup(inner_optimizer) -> class | None`."""
    _flavour_lookup[0] = lookup


class AccumulationProtocol:
    """Mixin: counters, pass-throughs and the per-micro-step protocol.

    The flavour class must set `inner_optimizer`, `accumulation_steps`,
    `_iterations` (micro-steps), `_pending_steps`, `_skipped_updates`,
    `_accumulators`, `compression` (None or a
    `keras_mgpu.compression.GradientCompression`), and implement, in replica
    context, for the `AccumulatorSlot`s of one micro-step:
    - `_decide(slots, compress) -> (finite, payload)`: whether the window's
      gradients are finite on every replica (identical everywhere), and
      what this replica hands the inner optimizer (a nest of tensors:
      gradients, compression state); `compress` is False before a delayed
      compression method starts;
    - `_apply_to_inner(payload, slots)`: one inner update, then empty the
      accumulators;
    - `_reset(slots)`: empty the accumulators.

    Constructing either flavour's class with the other flavour's inner
    optimizer builds the other class: the wrapper follows the optimizer it
    is given, whatever `TF_USE_LEGACY_KERAS` made the package default (Ray
    Train sets it while user code builds Keras 3 optimizers).
    """

    def __new__(cls, inner_optimizer: Any = None, *args: Any, **kwargs: Any):
        target = _flavour_lookup[0](inner_optimizer)
        # Only our own two classes redirect; a user's subclass keeps its
        # flavour (and its check names the mismatch).
        if (
            target is not None
            and cls is not target
            and cls.__module__
            in (
                "keras_mgpu.optimizers.gradient_accumulation",
                "keras_mgpu.optimizers.gradient_accumulation_tf_keras",
            )
        ):
            return target(inner_optimizer, *args, **kwargs)
        return super().__new__(cls)

    # The base-optimizer arguments only the inner optimizer takes (each
    # flavour adds its own).
    _INNER_ONLY_ARGUMENTS: tuple = INNER_ONLY_ARGUMENTS

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        accumulation_steps: int,
        *,
        name: str | None = None,
        momentum_correction: bool = False,
        compression: Any = None,
        **kwargs: Any,
    ) -> None:
        # One constructor for both flavours (documented on each flavour's
        # class); what differs is in the flavour's hooks: `_drop_arguments`,
        # `_check_inner`, `_check_compression`, `_init_base`,
        # `_take_over_from_inner`.
        self._drop_arguments(kwargs)
        reject_wrapper_arguments(kwargs, self._INNER_ONLY_ARGUMENTS)
        accumulation_steps = check_int(
            accumulation_steps, "accumulation_steps", minimum=1
        )
        self._check_inner(inner_optimizer)
        momentum_correction = check_momentum_correction(
            momentum_correction, inner_optimizer
        )
        compression = self._check_compression(compression)
        self._init_base(name)
        self.momentum_correction = momentum_correction
        self.compression = compression
        self.inner_optimizer = inner_optimizer
        self.accumulation_steps = accumulation_steps
        self._take_over_from_inner(inner_optimizer)

    def _drop_arguments(self, kwargs: dict) -> None:
        """Checks before the arguments', and keywords to drop unread."""

    def _check_compression(self, compression: Any) -> Any:
        return check_compression(compression, tf.distribute.get_strategy())

    def _add_slots(self, var_list: list) -> None:
        """An accumulator and a compression state per variable."""
        self._accumulators = [
            self._add_accumulator(variable) for variable in var_list
        ]
        # Created for every replica count (one replica does not compress),
        # so that checkpoints move between replica counts.
        self._compression_states = [
            self._add_compression_state(variable, index)
            for index, variable in enumerate(var_list)
        ]

    def _add_compression_state(self, reference: Any, index: int) -> tuple:
        """The state variables the compression method keeps for
        `reference` (e.g. PowerSGD's residual and factor), or (); named
        from the flavour's `_slot_prefix(reference)` (checkpoint names)."""
        if self.compression is None:
            return ()
        prefix = self._slot_prefix(reference)
        return tuple(
            self._add_replica_local(
                reference,
                f"{prefix}_{spec.name}",
                spec.shape,
                per_replica=spec.per_replica,
                initial_value=spec.initial_value,
            )
            for spec in self.compression.state_specs(reference, index)
        )

    # Clipping and weight decay are set on the inner optimizer and act once
    # per update; reading or setting them on the wrapper reaches the inner.
    clipnorm = _inner_setting("clipnorm")
    global_clipnorm = _inner_setting("global_clipnorm")
    clipvalue = _inner_setting("clipvalue")
    weight_decay = _inner_setting("weight_decay")

    # EMA of the weights is the inner optimizer's: it runs in the inner's
    # `apply`, once per update, on the updated weights. The wrapper shows
    # the inner's settings and averages because code that looks for them
    # finds the wrapper: Keras's `SwapEMAWeights` unwraps exactly one
    # `inner_optimizer` level, which under `mixed_float16` (where `compile`
    # puts a `LossScaleOptimizer` around the wrapper) is this wrapper.
    ema_momentum = _inner_setting("ema_momentum")
    ema_overwrite_frequency = _inner_setting("ema_overwrite_frequency")

    @property
    def use_ema(self) -> bool:
        """The inner optimizer's `use_ema` (set it there).

        Reads False while the base class builds the wrapper's own state,
        so that no second set of averages is created on the wrapper.
        """
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or self.__dict__.get("_building_own_state"):
            return False
        return bool(inner.use_ema)

    @use_ema.setter
    def use_ema(self, value: Any) -> None:
        # The base `__init__` assigns the wrapper's own (False) before the
        # inner exists; later assignments (tf_keras's LossScaleOptimizer
        # forwards its own) reach the inner, as `_inner_setting` does.
        inner = self.__dict__.get("inner_optimizer")
        if inner is not None:
            inner.use_ema = value

    @property
    def _model_variables_moving_average(self) -> list:
        """The inner optimizer's EMA variables, in the order of the
        wrapper's (identical) trainable variables. Absent (AttributeError)
        unless the inner keeps them, as on a plain optimizer."""
        inner = self.__dict__.get("inner_optimizer")
        averages = getattr(inner, "_model_variables_moving_average", None)
        if averages is None or self.__dict__.get("_building_own_state"):
            raise AttributeError(
                "The inner optimizer keeps no moving averages (it was "
                "created with use_ema=False, or is not built yet)."
            )
        return averages

    @property
    def iterations(self) -> Any:
        """Number of real updates (the inner optimizer's counter)."""
        return self.inner_optimizer.iterations

    @property
    def micro_steps(self) -> Any:
        """Number of micro-batches applied so far."""
        return self._iterations

    @property
    def pending_steps(self) -> Any:
        """Micro-batches accumulated in the current, unfinished window."""
        return self._pending_steps

    @property
    def skipped_updates(self) -> Any:
        """Windows dropped because the mean gradient was not finite."""
        return self._skipped_updates

    @property
    def accumulators(self) -> list:
        """The accumulator variables, one per trainable variable."""
        return list(self._accumulators)

    @property
    def optimizers(self) -> list:
        """A `keras.optimizers.MultiOptimizer` inner's sub-optimizers.

        Keras's `LearningRateScheduler`, `ReduceLROnPlateau` and
        `SwapEMAWeights` recognise a MultiOptimizer by this attribute (it
        refuses `learning_rate`) and set each sub-optimizer's rate; the
        wrapper shows it when its inner optimizer has it, and is otherwise
        without it (AttributeError), like a plain optimizer.
        """
        inner = self.__dict__.get("inner_optimizer")
        if inner is None or not hasattr(inner, "optimizers"):
            raise AttributeError(
                "The inner optimizer has no sub-optimizers (`optimizers` is "
                "a MultiOptimizer's attribute)."
            )
        return inner.optimizers

    @property
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    def finalize_variable_values(self, var_list: list) -> None:
        """Keras ends `fit` here: with EMA, the model takes the averages.

        Before the inner optimizer's first update there is no average to
        take (the weights are the model's only value): the overwrite then
        waits, as it does with Keras's own `gradient_accumulation_steps`,
        whose averages follow the weights until its first update.
        """
        if _made_no_update(self.inner_optimizer):
            return
        self.inner_optimizer.finalize_variable_values(var_list)

    def _ema_pair(self, variable: Any) -> tuple | None:
        """(model variable, its EMA average) as the variables the flavour's
        strategy updates, or None without an average. Flavour-specific."""
        raise NotImplementedError

    def _averages_follow_weights(
        self, slots: list, distribution: Any = None
    ) -> None:
        """Until the inner optimizer's first update, set each average to
        its weight (once per micro-step; a scalar test afterwards).

        Keras starts the averages at zero and sets them to the weights at
        the first update; within the first window, `fit`'s end and
        `SwapEMAWeights` would otherwise put zeros into the model. In
        cross-replica context (`distribution` given) each device's copy is
        written from the same device's weight, as Keras's `SwapEMAWeights`
        does; otherwise (no strategy) the average is assigned directly.
        """
        if not self.use_ema:
            return
        pairs = [self._ema_pair(slot.variable) for slot in slots]
        pairs = [pair for pair in pairs if pair is not None]
        if not pairs:
            return

        def follow() -> None:
            for variable, average in pairs:
                if distribution is None:
                    average.assign(tf.cast(variable, average.dtype))
                else:
                    distribution.extended.update(
                        average, lambda a, b: a.assign(b), args=(variable,)
                    )

        tf.cond(
            tf.equal(self.inner_optimizer.iterations, 0), follow, lambda: None
        )

    # Keras's per-variable hooks (what a custom optimizer overrides and
    # Keras's own tests call directly): the wrapper has no rule of its own,
    # its inner optimizer's rule is the one applied once per update.
    def update_step(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner_optimizer.update_step(*args, **kwargs)

    def _apply_weight_decay(self, variables: list) -> Any:
        return self.inner_optimizer._apply_weight_decay(variables)

    def _clip_gradients(self, grads: list) -> list:
        return self.inner_optimizer._clip_gradients(grads)

    def exclude_from_weight_decay(
        self, var_list: list | None = None, var_names: list | None = None
    ) -> None:
        """Exclude variables from the inner optimizer's weight decay.

        As on a plain optimizer (call it before the optimizer is built):
        `var_list` excludes those variables, `var_names` every variable
        whose name contains one of the strings.
        """
        self.inner_optimizer.exclude_from_weight_decay(
            var_list=var_list, var_names=var_names
        )

    def set_weights(self, weights: list) -> None:
        """Set the optimizer's state: one array per entry of `variables`, in
        that order (the wrapper's counters and accumulators, then the inner
        optimizer's iterations, learning rate and slots).

        An accumulator takes the value as the sum over replicas, as a
        restored checkpoint does.
        """
        if not (
            getattr(self, "built", False) or getattr(self, "_built", False)
        ):
            raise ValueError(
                "You are calling `set_weights()` on an optimizer that has "
                "not yet been built. Please call "
                "`optimizer.build(trainable_variables)` to create the "
                "optimizer weights before calling `set_weights()`."
            )
        variables = list(self.variables)
        weights = list(weights)
        if len(weights) != len(variables):
            raise ValueError(
                f"Argument `weights` must hold {len(variables)} arrays, one "
                "per entry of `optimizer.variables` (the wrapper's own, then "
                f"the inner optimizer's). Received: {len(weights)} arrays."
            )
        for variable, weight in zip(variables, weights):
            shape = tuple(getattr(weight, "shape", np.shape(weight)))
            if tuple(variable.shape) != shape:
                raise ValueError(
                    f"Optimizer variable {variable_name(variable)} has shape "
                    f"{tuple(variable.shape)}, not compatible with the "
                    f"provided weight shape {shape}."
                )
            variable.assign(weight)

    def _correct_momentum(self) -> None:
        """Momentum correction (Goyal et al., 2017, section 2.1).

        Keras's SGD velocity is `v = m*v - lr*g`: it carries the learning
        rate of past updates. When the rate changes from `lr_prev` to `lr`,
        scaling `v` by `lr / lr_prev` before the update makes the step equal
        to the rate-free form `u = m*u + g; w -= lr*u`, so a warmup or a
        decay does not drag the old rate along. Cross-replica context (or no
        strategy): the velocity and `previous_learning_rate` are mirrored
        and updated once, identically everywhere.
        """
        if not self.momentum_correction:
            return
        from keras_mgpu.schedules._optimizer_lr import learning_rate_tensor

        owner = self.inner_optimizer
        rate = tf.cast(learning_rate_tensor(owner), tf.float32)
        previous = self._previous_learning_rate
        # The first update (previous 0: no velocity yet) is left alone.
        ratio = tf.where(
            previous > 0.0, tf.math.divide_no_nan(rate, previous), 1.0
        )
        for velocity in owner.momentums:
            velocity.assign(velocity * tf.cast(ratio, velocity.dtype))
        previous.assign(rate)

    @property
    def previous_learning_rate(self) -> Any:
        """The learning rate of the last update (with `momentum_correction`),
        or None."""
        return getattr(self, "_previous_learning_rate", None)

    def _window_complete(self) -> tf.Tensor:
        return self._pending_steps >= self.accumulation_steps

    def _in_compression_phases(self, update) -> None:
        """Run `update(compress)` for this window: once, or, for a method
        that starts compressing after some updates, under a `tf.cond` on
        whether it has started (the collectives differ between the two, so
        the choice is taken where a branch may contain them)."""
        compression = getattr(self, "compression", None)
        active = (
            None if compression is None else compression.active(self.iterations)
        )
        if active is None:
            update(True)
        else:
            tf.cond(active, lambda: update(True), lambda: update(False))

    def _step_in_replica_context(self, slots: list) -> None:
        """No strategy (or one that never merges): all in replica context."""
        self._iterations.assign_add(1)
        self._pending_steps.assign_add(1)
        self._averages_follow_weights(slots)

        def update(compress):
            finite, payload = self._decide(slots, compress)

            def skip():
                self._skipped_updates.assign_add(1)
                self._reset(slots)

            def apply_update():
                self._correct_momentum()
                self._apply_to_inner(payload, slots)

            tf.cond(finite, apply_update, skip)
            self._pending_steps.assign(0)

        tf.cond(
            self._window_complete(),
            lambda: self._in_compression_phases(update),
            lambda: None,
        )

    def _step_in_cross_replica_context(self, distribution, slots) -> None:
        """Called through `merge_call`.

        The decision must be taken here, in cross-replica context:
        tf.distribute does not allow a `tf.cond` in replica context whose
        branch calls `merge_call`, which the inner optimizer's update does
        (the pattern of Keras's `LossScaleOptimizer`). The slots (variables
        and accumulators) reach the replica functions by closure: passed as
        arguments, `call_for_each_replica` would unwrap distributed
        variables to one device's component.
        """
        self._iterations.assign_add(1)
        self._pending_steps.assign_add(1)
        self._averages_follow_weights(slots, distribution)
        extended = distribution.extended

        def update(compress):
            finite_per_replica, payload_per_replica = (
                extended.call_for_each_replica(
                    lambda: self._decide(slots, compress)
                )
            )
            # Every replica computed the same flag from an all-reduce.
            finite = distribution.experimental_local_results(
                finite_per_replica
            )[0]

            def apply_update():
                self._correct_momentum()
                extended.call_for_each_replica(
                    lambda payload: self._apply_to_inner(payload, slots),
                    args=(payload_per_replica,),
                )

            def skip_update():
                self._skipped_updates.assign_add(1)
                extended.call_for_each_replica(lambda: self._reset(slots))

            tf.cond(finite, apply_update, skip_update)
            self._pending_steps.assign(0)

        tf.cond(
            self._window_complete(),
            lambda: self._in_compression_phases(update),
            lambda: None,
        )

    def _step(self, slots: list) -> None:
        """After this replica accumulated: count, and update if due."""
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            # No strategy at all, or XLA on all-GPU MirroredStrategy.
            self._step_in_replica_context(slots)
        else:
            tf.distribute.get_replica_context().merge_call(
                lambda distribution: self._step_in_cross_replica_context(
                    distribution, slots
                )
            )

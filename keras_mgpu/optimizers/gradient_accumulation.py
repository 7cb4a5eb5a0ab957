"""Gradient accumulation as a Keras 3 optimizer wrapper, exact under
`tf.distribute` (TensorFlow) and `keras.distribution` (JAX).

The TensorFlow path lives here; what only JAX does is in
`keras_mgpu/backend/jax/accumulation.py`, reached from `apply`."""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from typing import Any

from keras_mgpu import compression as compression_lib
from keras_mgpu._flavour import (
    TF_RUNS,
    check_flavour,
    keras_of,
    register_serializable,
    tf,
)
from keras_mgpu.backend import (
    require_backend,
)
from keras_mgpu.normalization._warn import check_from_optimizer
from keras_mgpu.optimizers._accumulation_common import (
    INNER_ONLY_ARGUMENTS,
    MAXIMUM,
    SPARSE,
    AccumulationProtocol,
    AccumulatorSlot,
    all_finite,
    all_reduce_sum,
    assign_compression_state,
    check_inner_is_not_a_wrapper,
    divide_gradient,
    is_sparse,
    overwrites_with_gradient,
    reduce_before_the_inner,
    scatter_add_locally,
    touched_rows,
    variable_name,
)
from keras_mgpu.optimizers._accumulation_context import (
    _check_jax_compression,
    _check_keras_limits,
    _has_clipping,
    _inner_reduction_skipped,
    _replica_share,
    _slot_kind,
)

# Keras 3 whatever TF_USE_LEGACY_KERAS says: this class serves Keras 3
# optimizers (keras_mgpu.GradientAccumulationOptimizer picks it for them).
keras = keras_of("keras3")

_INNER_ONLY_ARGUMENTS = INNER_ONLY_ARGUMENTS + (
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


@functools.partial(register_serializable, flavour="keras3")
class GradientAccumulationOptimizer(
    AccumulationProtocol, keras.optimizers.Optimizer
):
    """Accumulates gradients over `accumulation_steps` micro-batches, then
    applies their mean with the inner optimizer.

    After `K = accumulation_steps` calls to `apply` on `R` replicas, the model
    variables equal those of one step of the inner optimizer on the
    concatenation of the `K·R` micro-batches (mean loss), to float rounding.
    That holds for every inner optimizer (SGD, momentum, Nesterov, Adam,
    AdamW, RMSprop, Adafactor, Lion, ...) because the inner optimizer runs
    exactly once per update, on the mean gradient: weight decay, EMA and
    learning-rate schedules advance once per update, not per micro-batch.

    **Counters.** `iterations` is the inner optimizer's update counter (what
    schedules, EMA and `keras_mgpu` LR callbacks read). `micro_steps` counts
    every call to `apply`; `pending_steps` is the number of micro-batches
    accumulated in the current window (0 right after an update).

    **Under `tf.distribute`.** Each replica adds its gradients to its own
    accumulators (`ON_READ` variables with `SUM` aggregation, local to the
    device: no communication). Once per window, the update decision is taken
    in cross-replica context, and the inner optimizer's `apply` all-reduces
    the accumulated mean gradient once. Gradient clipping (`clipnorm`,
    `global_clipnorm`, `clipvalue` set on the inner optimizer) is applied to
    the *reduced* mean gradient, as on one device (Keras 3.15 itself clips
    each replica's partial gradient under `MirroredStrategy`): the wrapper
    then all-reduces the mean itself and the inner optimizer does not
    reduce again, so the update still takes one all-reduce (and no separate
    finiteness flag). Before an update, the wrapper checks that
    the reduced mean gradient is finite; if not, the whole window is
    skipped identically on every replica (`skipped_updates` counts them) and
    the accumulators restart from zero. That makes mixed precision
    (`LossScaleOptimizer`, which `compile` adds around this wrapper) safe
    under `MirroredStrategy`, where Keras decides "finite?" per replica.

    **On JAX (`keras.distribution`).** The jitted step is one program over
    the device mesh, so the gradients handed to the wrapper are already the
    global micro-batch's; the wrapper adds them to its accumulators and,
    once per window, hands the mean to the inner optimizer's
    `stateless_apply` inside a `keras.ops.cond` (`jax.lax.cond`: the update
    runs only at the end of a window, not every micro-step as with Keras's
    `gradient_accumulation_steps`). The inner optimizer's `iterations`,
    schedule, clipping (on the global mean), weight decay and EMA advance
    only there. Accumulators are made with `add_variable_from_reference`,
    so they take each variable's layout: replicated under `DataParallel`,
    sharded like their variable under `ModelParallel`. Works in `fit`
    (`jit_compile` on or off, `steps_per_execution`) and in a custom loop
    of `model.stateless_call` + `jax.grad` + `optimizer.stateless_apply`
    inside `jax.jit`. Cross-device reductions: XLA reduces a gradient where
    it is computed, before any optimizer sees it, so a micro-step that is
    its own compiled call (every `fit` step; measured: one combined
    all-reduce per step under `DataParallel`) costs one reduction, `K` per
    update, as without accumulation, with the default `reduction="auto"`.
    To reduce once per update in `fit`, pass `reduction="per_update"`
    (below); in a custom loop, sum the micro-batches' gradients inside one
    compiled call (a `jax.lax.scan`: XLA then reduces once, measured) and
    hand the wrapper that call's mean as one micro-step.
    `compression` is TensorFlow only and refused at construction on JAX.

    **`reduction="per_update"` (JAX).** The gradients cross devices once
    per window instead of once per micro-step. Each accumulator gets a
    leading axis of one row per device on the data axis, sharded over it
    (`(R, *shape)`: each device holds one row, the memory of a replicated
    accumulator). When `fit` builds the optimizer (or
    `keras.models.load_model` restores it), the model's train step is
    replaced, on that model instance, by one that takes each device's
    gradient of its own shard of the micro-batch (a `jax.shard_map` over
    the data axis, no cross-device sum) and adds it to that device's row;
    at the window's end the mean over rows and micro-steps is taken once
    (one all-reduce of the gradients' size) and handed to the inner
    optimizer as with "auto": clipping of the global mean, EMA, schedules,
    the static `loss_scale_factor` and skipped non-finite windows are
    unchanged, and the result equals the large batch to float rounding.
    What still crosses devices every micro-step: the loss's and metrics'
    sums (scalars) and the new values of float non-trainable variables the
    step changes (`BatchNormalization` moving statistics, averaged over
    devices; each device normalises its shard with its own statistics, as
    under `tf.distribute`). Random layers draw per device (the device
    index is folded into their seed). The global micro-batch must split
    evenly over the devices. Rules:
    - refused at construction (ValueError) under a distribution other
      than `DataParallel` (a `ModelParallel` may shard weights), and when
      the optimizer is built if a variable is sharded;
    - refused when `fit` builds the optimizer (ValueError) if the model's
      class overrides `train_step`, or if `compile` wrapped the optimizer
      in a `LossScaleOptimizer` (`mixed_float16`: its dynamic scale is out
      of the per-device step's reach): use "auto" there;
    - an optimizer built by hand (`optimizer.build(...)` before `fit`)
      leaves Keras's step in place: its already reduced gradients are
      copied into every row, the updates stay exact, and a warning says
      that each micro-step then reduces;
    - saved accumulators hold one row per device: restore onto as many
      devices on the data axis;
    - TensorFlow (Keras 3): accepted and changes nothing, since
      `tf.distribute` already reduces once per update there; the tf_keras
      flavour takes no `reduction` argument (TypeError).

    **EMA.** `use_ema=True` on the inner optimizer averages the weights
    once per update, in the inner's `apply`. The wrapper reads `use_ema`,
    `ema_momentum`, `ema_overwrite_frequency` and the averages from the
    inner, so Keras's `SwapEMAWeights` finds them also under
    `mixed_float16`, where it unwraps the `LossScaleOptimizer` around the
    wrapper and stops at the wrapper; `fit` ends on the averages through
    `finalize_variable_values`, as with a plain optimizer.

    **State.** Accumulators and counters are optimizer variables, so
    `tf.train.Checkpoint`, `.keras` files and `BackupAndRestore` resume in
    the middle of an accumulation window. The accumulators are saved as the
    sum over replicas; restored, each replica holds an equal share, which
    gives the same update (even on a different number of replicas).

    **Sparse gradients** (`tf.IndexedSlices`, e.g. from `Embedding`) are
    scattered into the accumulator (only the looked-up rows are written);
    at the update the inner optimizer receives the mean of the rows touched
    in the window, again as `tf.IndexedSlices` (unique indices, repeated
    lookups summed), so an optimizer that updates sparsely still does, and
    rows without a gradient keep their value even under a non-additive
    sparse update. A touched row whose gradients cancel to exactly zero is
    left out, which no optimizer whose sparse update equals its dense one
    can tell apart.

    **float8** (`overwrite_with_gradient` variables: scales and amax
    histories) are not averaged: as with Keras's own
    `gradient_accumulation_steps`, the window's maximum (from zero) is kept
    and, at the update, written to the variable by the inner optimizer
    without clipping or loss scaling. Under `tf.distribute` the maximum is
    also taken over replicas (one small all-gather per micro-step), so every
    replica holds one large batch's amax.

    **Non-trainable weights** (e.g. `BatchNormalization` moving statistics)
    are not touched by optimizers: they keep updating on every micro-batch's
    forward pass, as with any Keras model. Their values after a window
    therefore differ from one large-batch step (K momentum updates with
    micro-batch statistics instead of one with large-batch statistics).
    With `accumulation_steps > 1`, a model with trainable
    BatchNormalization layers and no choice made about them gets one
    `keras_mgpu.normalization.BatchNormMicroBatchWarning` (the model is
    found when `fit` builds the optimizer or its `train_step` applies it;
    a custom loop calling `apply` outside a model's `train_step` is not
    warned about); see docs/guides/batchnorm.md for the remedies.

    Args:
        inner_optimizer: A Keras 3 `keras.optimizers.Optimizer` that applies
            the accumulated gradients. Its `learning_rate`, weight decay,
            clipping and EMA settings are used once per update.
        accumulation_steps: int >= 1. Micro-batches per update.
        momentum_correction: bool (default False). With an SGD inner
            optimizer with momentum, rescale its velocity by
            `new_rate / previous_rate` whenever the learning rate changes
            (warmup, decay, `ReduceLROnPlateau`), as Goyal et al. (2017)
            recommend for large-batch training. Keras's SGD keeps the rate
            inside the velocity; without the correction a rate change takes
            effect only gradually. Use `accumulation_steps=1` to get the
            correction without accumulation. The last rate is kept in the
            optimizer variable `previous_learning_rate` (checkpointed).
        compression: None (default), "float16", "bfloat16", a
            `keras_mgpu.compression.PowerSGD(rank=...)` or another
            `keras_mgpu.compression.GradientCompression`: the form in which
            the window's mean gradient crosses devices and workers, once
            per update (a no-op with one replica). Clipping and the
            finiteness check apply to the decompressed mean; the method's
            state (PowerSGD residuals and factors) is optimizer variables.
            See the compression guide. TensorFlow only (refused on JAX,
            where XLA runs the step's reductions).
        reduction: "auto" (default) or "per_update": how often gradients
            cross devices on JAX under `keras.distribution.DataParallel`.
            "auto" keeps Keras's train step (one all-reduce per
            micro-step); "per_update" takes per-device gradients and
            all-reduces once per window (see above). TensorFlow reduces
            once per update with either. "per_update" follows private code
            of Keras's JAX trainer and is refused (ValueError naming the
            functions) on a Keras whose code differs from the releases it
            was tested with (3.13-3.15).
        name: Optional name; defaults to a name derived from the class.

    Example:

    ```python
    import keras
    import keras_mgpu

    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(
        optimizer=keras_mgpu.GradientAccumulationOptimizer(
            keras.optimizers.Adam(1e-3), accumulation_steps=4
        ),
        loss="mse",
    )
    ```

    On JAX, under a `keras.distribution` (create the model and the
    optimizer in its scope, so their variables take its layouts):

    ```python
    import keras
    import keras_mgpu

    with keras.distribution.DataParallel().scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        inner = keras.optimizers.Adam(1e-3)
        optimizer = keras_mgpu.GradientAccumulationOptimizer(inner, 4)
        model.compile(optimizer=optimizer, loss="mse")
    ```

    One all-reduce per update on JAX (`fit` as usual):

    ```python
    import keras
    import numpy as np
    import keras_mgpu

    with keras.distribution.DataParallel().scope():
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
        optimizer = keras_mgpu.GradientAccumulationOptimizer(
            keras.optimizers.Adam(1e-3), 4, reduction="per_update"
        )
        model.compile(optimizer=optimizer, loss="mse")
        x = np.zeros((64, 4), "float32")
        model.fit(x, x[:, :1], batch_size=8, verbose=0)
    ```
    """

    _INNER_ONLY_ARGUMENTS = _INNER_ONLY_ARGUMENTS

    # With `reduction="per_update"` on JAX, set at build: the rows (devices
    # on the data axis) of each per-device accumulator.
    _per_device_rows = None
    _warned_reduced = False

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        accumulation_steps: int,
        *,
        name: str | None = None,
        momentum_correction: bool = False,
        compression: Any = None,
        reduction: str = "auto",
        **kwargs: Any,
    ) -> None:
        reduction = _check_reduction(reduction)
        super().__init__(
            inner_optimizer,
            accumulation_steps,
            name=name,
            momentum_correction=momentum_correction,
            compression=compression,
            **kwargs,
        )
        self.reduction = reduction

    @property
    def _per_device_accumulation(self) -> bool:
        """Whether gradients are accumulated per device and reduced once
        per update (`reduction="per_update"` on JAX)."""
        return self.reduction == "per_update" and not TF_RUNS

    # The rest of the constructor is `AccumulationProtocol.__init__`; these
    # are its Keras 3 hooks.
    def _drop_arguments(self, kwargs: dict) -> None:
        require_backend("GradientAccumulationOptimizer")

    def _check_compression(self, compression: Any) -> Any:
        if TF_RUNS:
            return super()._check_compression(compression)
        return _check_jax_compression(compression)

    def _init_base(self, name: str | None) -> None:
        keras.optimizers.Optimizer.__init__(self, learning_rate=0.0, name=name)

    def _take_over_from_inner(self, inner_optimizer: Any) -> None:
        # Loss scaling belongs to the outermost optimizer, as with
        # LossScaleOptimizer: take the inner's factor over so gradients are
        # unscaled once, before they are accumulated.
        self.loss_scale_factor = inner_optimizer.loss_scale_factor
        inner_optimizer.loss_scale_factor = None

    @staticmethod
    def _check_inner(inner_optimizer: Any) -> None:
        check_flavour(inner_optimizer, "inner_optimizer", "keras3")
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "Argument `inner_optimizer` must be a Keras 3 "
                "`keras.optimizers.Optimizer` instance. Received: "
                f"inner_optimizer={inner_optimizer!r} (of type "
                f"{type(inner_optimizer).__name__})"
            )
        check_inner_is_not_a_wrapper(
            inner_optimizer,
            GradientAccumulationOptimizer,
            keras.optimizers.LossScaleOptimizer,
        )
        builtin = inner_optimizer.gradient_accumulation_steps
        if builtin:
            raise ValueError(
                "Argument `inner_optimizer` has its own "
                f"gradient_accumulation_steps={builtin}. Use only the "
                "wrapper: create the inner optimizer without "
                "`gradient_accumulation_steps` and pass "
                f"accumulation_steps={builtin} to "
                "GradientAccumulationOptimizer."
            )

    # ------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------
    def build(self, var_list: list) -> None:
        if self.built:
            return
        # `fit` builds the optimizer from the model's `_symbolic_build`:
        # the model is on the stack (BatchNormalization warning, once).
        check_from_optimizer(self, var_list)
        self.inner_optimizer.build(var_list)
        self._start_averages_at_the_weights()
        # The base build would create EMA variables for a `use_ema` that
        # reads the inner's; the inner's own `apply` keeps the averages.
        self._building_own_state = True
        try:
            super().build(var_list)
        finally:
            self._building_own_state = False
        if not TF_RUNS:
            self._build_for_jax(var_list)
            return
        # The wrapper's own `_iterations` counts micro-steps.
        self._add_counters("int64")
        self._add_slots(var_list)
        # Under CentralStorageStrategy (and parameter servers) an `ON_READ`
        # variable is one `AggregatingVariable` on the parameter device:
        # replicas' writes are summed into it, so every replica reads the
        # global sum instead of its own part.
        self._accumulators_are_shared = bool(var_list) and not isinstance(
            self._accumulators[0].value, tf.distribute.DistributedValues
        )

    def _start_averages_at_the_weights(self) -> None:
        """The inner optimizer's EMA averages (Keras creates them as zeros)
        start as the weights, so that nothing reading them before the first
        update (the end of `fit`, `SwapEMAWeights`) finds zeros. Each
        micro-step before that update sets them again (the weights may have
        been loaded since)."""
        inner = self.inner_optimizer
        if not inner.use_ema:
            return
        if not TF_RUNS:
            from keras.src.backend.common.stateless_scope import (
                in_stateless_scope,
            )

            # Keras 3.15's private check: inside `stateless_apply` an
            # assignment would go to the scope, not the variable; the
            # micro-steps set the averages there.
            if in_stateless_scope():
                return
        elif tf.inside_function():
            # Built inside a traced step (the first `apply` of `fit`): the
            # micro-steps set the averages there (`tf.cond` on the inner
            # counter); lifted out of the trace, a read of a weight created
            # by the same trace has no value yet (Keras's own EMA tests).
            return
        with tf.init_scope() if TF_RUNS else contextlib.nullcontext():
            for variable in inner._trainable_variables:
                pair = self._ema_pair(variable)
                if pair is not None:
                    # A copy: on JAX two variables sharing one buffer
                    # would both be donated to the next jitted step.
                    pair[1].assign(keras.ops.copy(pair[0]))

    def _ema_pair(self, variable: Any) -> tuple | None:
        inner = self.inner_optimizer
        average = inner._model_variables_moving_average[
            inner._get_variable_index(variable)
        ]
        if average is None:  # overwritten with its gradient: no average
            return None
        if not TF_RUNS:
            return variable, average
        # The `tf.Variable`s a strategy's `extended.update` takes.
        if isinstance(variable, keras.Variable):
            variable = variable.value
        return variable, average.value

    def _add_counters(self, dtype: str) -> None:
        """The window's micro-step and skipped-update counters (and, with
        `momentum_correction`, the rate of the last update): one value for
        every replica."""
        for name in ("pending_steps", "skipped_updates"):
            setattr(
                self,
                f"_{name}",
                self.add_variable(
                    shape=(),
                    dtype=dtype,
                    aggregation="only_first_replica",
                    name=name,
                ),
            )
        if self.momentum_correction:
            self._previous_learning_rate = self.add_variable(
                shape=(),
                dtype="float32",
                aggregation="only_first_replica",
                name="previous_learning_rate",
            )

    def _build_for_jax(self, var_list: list) -> None:
        """Counters and accumulators on JAX: plain optimizer variables.

        Each accumulator is made by `add_variable_from_reference`, which
        gives it its variable's layout under `keras.distribution`
        (replicated under `DataParallel`, sharded like the variable under
        `ModelParallel`). int32 counters: JAX without x64 has no int64.
        """
        self._add_counters("int32")
        self._compression_states = [() for _ in var_list]
        self._accumulators_are_shared = False
        if self._per_device_accumulation:
            self._build_per_device(var_list)
            return
        self._accumulators = [
            self.add_variable_from_reference(variable, name="accumulator")
            for variable in var_list
        ]

    def _build_per_device(self, var_list: list) -> None:
        """`reduction="per_update"`: one accumulator row per device on the
        data axis (`(R, *shape)`, the rows sharded over that axis: each
        device holds its own, as much memory as a replicated accumulator),
        and the per-device train step installed on the model being built
        (by `fit`, or by loading a saved model)."""
        from keras_mgpu.backend.jax import reduction as reduction_lib

        reason = reduction_lib.check_distribution() or (
            reduction_lib.check_replicated(var_list)
        )
        if reason:
            raise ValueError(
                f"GradientAccumulationOptimizer(reduction='per_update') "
                f"cannot run here: {reason}. Use reduction='auto'."
            )
        _, _, rows = reduction_lib.data_axis()
        self._per_device_rows = rows
        self._accumulators = [
            self.add_variable(
                shape=(rows, *variable.shape),
                dtype=variable.dtype,
                layout=reduction_lib.per_device_accumulator_layout(
                    None, len(variable.shape) + 1
                ),
                name=self._slot_prefix(variable) + "_accumulator",
            )
            for variable in var_list
        ]
        model = _model_building(var_list)
        if model is not None:
            reduction_lib.install(model)

    def _add_accumulator(self, reference: Any) -> Any:
        """One replica-local accumulator shaped like `reference`.

        `ON_READ` + `SUM`: writes in replica context stay on the replica's
        device; a read in cross-replica context (saving) sums the replicas,
        and a restore splits the sum evenly, so the total is preserved.
        A variable Keras overwrites with its gradient (float8 scales and
        amax histories) gets a running maximum instead, kept identical on
        every replica: `ONLY_FIRST_REPLICA` saves one copy and restores it
        to all.
        """
        return self._add_replica_local(
            reference,
            variable_name(reference).replace("/", "_") + "_accumulator",
            shape=reference.shape,
            per_replica=not overwrites_with_gradient(reference),
        )

    def _slot_prefix(self, reference: Any) -> str:
        return variable_name(reference).replace("/", "_")

    def _add_replica_local(
        self,
        reference: Any,
        name: str,
        shape: tuple,
        per_replica: bool,
        initial_value: Any = None,
    ) -> Any:
        """An optimizer variable beside `reference`, written by each replica
        in replica context: `per_replica` values are summed when saved and
        split when restored (`SUM`); others are the same on every replica
        (`ONLY_FIRST_REPLICA`)."""
        if isinstance(reference, keras.Variable):
            colocate = reference.value
        else:  # a raw tf.Variable, which plain Keras optimizers accept
            colocate = reference
        dtype = reference.dtype
        if initial_value is None:
            initializer = "zeros"
        else:
            initializer = initial_value().astype(
                keras.backend.standardize_dtype(dtype)
            )
        with self._distribution_strategy.extended.colocate_vars_with(colocate):
            with keras.name_scope(self.name, caller=self):
                variable = keras.Variable(
                    initializer=initializer,
                    shape=shape,
                    dtype=dtype,
                    trainable=False,
                    aggregation="sum" if per_replica else "only_first_replica",
                    synchronization="on_read",
                    name=name,
                )
        self._track_variable(variable)
        return variable

    @property
    def variables(self) -> list:
        return self._variables + self.inner_optimizer.variables

    def _get_current_learning_rate(self) -> Any:
        return self.inner_optimizer._get_current_learning_rate()

    def stateless_apply(self, optimizer_variables, grads, trainable_variables):
        """On JAX: `apply` in a `StatelessScope` (Keras's base method),
        returning the new model and optimizer variable values."""
        if TF_RUNS:
            raise NotImplementedError(
                "GradientAccumulationOptimizer.stateless_apply runs on the "
                "JAX backend; on TensorFlow use `apply`."
            )
        return super().stateless_apply(
            optimizer_variables, grads, trainable_variables
        )

    # ------------------------------------------------------------------
    # Applying gradients
    # ------------------------------------------------------------------
    def apply(self, grads: list, trainable_variables: list | None = None):
        grads = list(grads)
        if not grads:
            return
        if trainable_variables is None:
            if not self.built:
                raise ValueError(
                    "When passing `grads` without `trainable_variables`, "
                    "the optimizer must already be built. Call "
                    "`optimizer.build(trainable_variables)` first."
                )
            trainable_variables = self._trainable_variables
        trainable_variables = list(trainable_variables)
        # The model's `train_step` is on the stack (a dictionary lookup
        # once the model was found or given up on).
        check_from_optimizer(self, trainable_variables)
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
        if not TF_RUNS:
            self._apply_on_jax(grads, trainable_variables)
            return
        if tf.distribute.in_cross_replica_context():
            raise ValueError(
                "GradientAccumulationOptimizer.apply() must be called in a "
                "replica context (inside `strategy.run` or `model.fit`)."
            )
        _check_keras_limits()
        grads, trainable_variables = self._drop_missing(
            grads, trainable_variables
        )
        if not grads:
            self.inner_optimizer.apply(
                [None] * len(self._trainable_variables),
                self._trainable_variables,
            )
            return
        slots = []
        for grad, variable in zip(grads, trainable_variables):
            index = self._get_variable_index(variable)
            slots.append(
                AccumulatorSlot(
                    variable,
                    self._accumulators[index],
                    _slot_kind(grad, variable),
                    self._compression_states[index],
                )
            )
        with keras.name_scope(self.name, caller=self):
            self._accumulate(grads, slots)
            self._step(slots)

    def _apply_on_jax(self, grads: list, trainable_variables: list) -> None:
        from keras_mgpu.backend.jax.accumulation import apply_accumulation

        if len(grads) != len(trainable_variables):
            raise ValueError(
                f"Received {len(grads)} gradients for "
                f"{len(trainable_variables)} variables: `grads` must match "
                "`trainable_variables` one to one."
            )
        grads, trainable_variables = self._drop_missing(
            grads, trainable_variables
        )
        if not grads:
            raise ValueError("No gradients provided for any variable.")
        if self._per_device_rows and not self._warned_reduced:
            rows = [
                len(g.shape) == len(v.shape)
                for g, v in zip(grads, trainable_variables)
            ]
            if all(rows) and self._per_device_rows > 1:
                self._warned_reduced = True
                warnings.warn(
                    "GradientAccumulationOptimizer(reduction='per_update') "
                    "received gradients already reduced over devices (the "
                    "model's train step is Keras's: the optimizer was built "
                    "outside `fit`, e.g. by `optimizer.build(...)`). The "
                    "updates stay exact, with one reduction per micro-step. "
                    "Let `fit` (or `keras.models.load_model`) build the "
                    "optimizer to reduce once per update.",
                    stacklevel=3,
                )
        with keras.name_scope(self.name, caller=self):
            apply_accumulation(
                self,
                grads,
                trainable_variables,
                [overwrites_with_gradient(v) for v in trainable_variables],
            )

    @staticmethod
    def _drop_missing(grads: list, variables: list) -> tuple:
        """Leave out variables without a gradient (None, known while
        tracing), with Keras's warning: the inner optimizer gets none for
        them either, exactly as without accumulation. A zero gradient would
        not be the same (weight decay, momentum)."""
        missing = [
            variable_name(v) for g, v in zip(grads, variables) if g is None
        ]
        if missing:
            warnings.warn(
                f"Gradients do not exist for variables {missing} when "
                "minimizing the loss; GradientAccumulationOptimizer leaves "
                "them unchanged.",
                stacklevel=3,
            )
        kept = [(g, v) for g, v in zip(grads, variables) if g is not None]
        return [g for g, _ in kept], [v for _, v in kept]

    def _accumulate(self, grads: list, slots: list) -> None:
        """Add this replica's gradients to its own accumulators (local)."""
        for grad, slot in zip(grads, slots):
            if slot.kind == MAXIMUM:
                self._accumulate_maximum(grad, slot.accumulator)
                continue
            grad = tf.cast(grad, slot.accumulator.dtype)
            if self.loss_scale_factor is not None:
                grad = divide_gradient(grad, self.loss_scale_factor)
            if isinstance(grad, tf.IndexedSlices):
                # Only the looked-up rows are written.
                scatter_add_locally(slot.accumulator.value, grad)
            else:
                # `tf.Variable.assign_add`, not `keras.Variable.assign_add`:
                # Keras implements the latter as `assign(self + value)`,
                # which an `AggregatingVariable` (CentralStorageStrategy)
                # sums over replicas, old value included (Keras 3.15).
                slot.accumulator.value.assign_add(grad)

    def _accumulate_maximum(self, value: Any, accumulator: Any) -> None:
        """Keep the running maximum of a variable Keras overwrites with its
        "gradient" (float8 scale or amax history), as Keras's own
        `gradient_accumulation_steps` does (`ops.maximum`, from zero); it is
        neither loss-scaled nor averaged. The maximum is also taken over
        replicas, so every replica holds the same value (one large batch's
        amax) and saves and restores exactly.
        """
        value = tf.cast(tf.convert_to_tensor(value), accumulator.dtype)
        context = tf.distribute.get_replica_context()
        if context.num_replicas_in_sync > 1:
            gathered = context.all_gather(value[tf.newaxis], axis=0)
            value = tf.reduce_max(gathered, axis=0)
        accumulator.assign(tf.maximum(accumulator.value, value))

    def _local_mean(self, slot: AccumulatorSlot) -> Any:
        """This replica's share of a slot's mean gradient (the shares sum
        to it): a dense tensor, or the touched rows for a sparse slot."""
        divisor = self.accumulation_steps
        if self._accumulators_are_shared:
            context = tf.distribute.get_replica_context()
            divisor *= context.num_replicas_in_sync
        total = tf.convert_to_tensor(slot.accumulator.value)
        if slot.kind == SPARSE:
            return touched_rows(total, divisor)
        return total / divisor

    def _decide(self, slots: list, compress: bool = True) -> tuple:
        """Replica context: (finite everywhere?, (what the inner receives,
        the new compression state)).

        The mean gradients come from `_reduce_means` (the update's one
        all-reduce happens there or in the inner optimizer). A variable Keras
        overwrites with its gradient gets the window's maximum, already the
        same on every replica, and no clipping, averaging or compression.
        """
        summed = [slot for slot in slots if slot.kind != MAXIMUM]
        finite, means, states = self._reduce_means(summed, compress)
        means, states = iter(means), iter(states)
        grads, state_values = [], []
        for slot in slots:
            if slot.kind == MAXIMUM:
                grads.append(tf.convert_to_tensor(slot.accumulator.value))
                state_values.append(())
            else:
                grads.append(next(means))
                state_values.append(next(states))
        maxima = [g for g, slot in zip(grads, slots) if slot.kind == MAXIMUM]
        finite = tf.logical_and(finite, all_finite(maxima))
        return finite, (grads, state_values)

    def _reduces_before_the_inner(self) -> bool:
        """Whether the update's all-reduce happens in the wrapper (replica
        context): with compression, or clipping, under several replicas."""
        context = tf.distribute.get_replica_context()
        return context.num_replicas_in_sync > 1 and (
            self.compression is not None or _has_clipping(self.inner_optimizer)
        )

    def _reduce_means(self, slots: list, compress: bool = True) -> tuple:
        """Replica context: (finite everywhere?, the mean gradient or this
        replica's share of it, the new compression state of each slot).

        With compression or clipping under several replicas, the means are
        all-reduced here once (compressed unless `compress` is False, i.e.
        before a delayed method starts) and every replica hands the whole
        mean to the inner optimizer, which then neither reduces again nor
        clips anything but the reduced mean. Otherwise each replica hands
        over its local mean and the inner optimizer all-reduces it (one
        all-reduce per update); only a scalar "non-finite" count crosses
        devices beforehand. Sparse means under several replicas are reduced
        here in either case: tf.distribute sums slices by concatenating
        them, so the inner would see a row touched on two replicas twice,
        which Keras applies unsummed (Adagrad, RMSprop); they go to the
        inner as shares (all rows on the first replica).
        """
        context = tf.distribute.get_replica_context()
        local = [self._local_mean(slot) for slot in slots]
        if self._reduces_before_the_inner():
            compression = self.compression if compress else None
            return reduce_before_the_inner(context, local, slots, compression)
        sparse = [i for i, g in enumerate(local) if is_sparse(g)]
        if sparse and context.num_replicas_in_sync > 1:
            reduced = all_reduce_sum(context, [local[i] for i in sparse])
            for i, grad in zip(sparse, reduced):
                local[i] = _replica_share(context, grad)
        nonfinite = tf.cast(tf.logical_not(all_finite(local)), tf.float32)
        nonfinite = context.all_reduce(tf.distribute.ReduceOp.SUM, nonfinite)
        return tf.equal(nonfinite, 0.0), local, [()] * len(local)

    def _apply_to_inner(self, payload: tuple, slots: list) -> None:
        """Replica context: one inner update, then empty the accumulators.

        Variables Keras overwrites with their gradient go to the inner
        optimizer too, with the window's maximum: its own `apply` assigns
        them, as without accumulation. The compression state computed for
        this update is written now (not for a skipped window).
        """
        grads, state_values = payload
        assign_compression_state(slots, state_values)
        variables = [slot.variable for slot in slots]
        if self._reduces_before_the_inner():
            with _inner_reduction_skipped(self.inner_optimizer):
                self.inner_optimizer.apply(grads, variables)
        else:
            self.inner_optimizer.apply(grads, variables)
        self._reset(slots)

    def _reset(self, slots: list) -> None:
        for slot in slots:
            slot.accumulator.assign(tf.zeros_like(slot.accumulator.value))

    def scale_loss(self, loss: Any) -> Any:
        if self.loss_scale_factor is not None:
            return loss * self.loss_scale_factor
        return loss

    # ------------------------------------------------------------------
    # Serialization
    # ------------------------------------------------------------------
    def get_config(self) -> dict:
        inner = self.inner_optimizer
        # Hand back the loss scale factor to the inner optimizer's config,
        # where it was given.
        inner_config = keras.saving.serialize_keras_object(inner)
        if self.loss_scale_factor is not None:
            inner_config["config"]["loss_scale_factor"] = self.loss_scale_factor
        return {
            "name": self.name,
            "inner_optimizer": inner_config,
            "accumulation_steps": self.accumulation_steps,
            "momentum_correction": self.momentum_correction,
            "compression": compression_lib.serialize(self.compression),
            "reduction": self.reduction,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects=None):
        # Deserializing replaces nested configs (a schedule's) with objects
        # in place: work on a copy, so the caller's config stays a config.
        config = copy.deepcopy(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)


_REDUCTIONS = ("auto", "per_update")


def _check_reduction(reduction: Any) -> str:
    """Validate `reduction` at construction (and, on JAX, the distribution
    in force for "per_update")."""
    if not isinstance(reduction, str) or reduction not in _REDUCTIONS:
        raise ValueError(
            "Argument `reduction` must be one of "
            f"{', '.join(repr(r) for r in _REDUCTIONS)}. Received: "
            f"reduction={reduction!r}"
        )
    if reduction == "per_update" and not TF_RUNS:
        from keras_mgpu.backend.jax.reduction import (
            check_distribution,
            check_keras_code,
        )

        reason = check_keras_code() or check_distribution()
        if reason:
            raise ValueError(
                "Argument `reduction='per_update'` cannot apply: "
                f"{reason}. Use reduction='auto' (one reduction per "
                "micro-step)."
            )
    return reduction


def _model_building(variables: list) -> Any:
    """The Keras model on the call stack (a method of it: `fit`'s
    `_symbolic_build`, `compile_from_config` when loading) that owns
    `variables`, or None (an optimizer built by hand)."""
    import sys

    wanted = {id(v) for v in variables}
    frame = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, keras.Model) and any(
            id(v) in wanted for v in candidate.trainable_variables
        ):
            return candidate
        frame = frame.f_back
    return None

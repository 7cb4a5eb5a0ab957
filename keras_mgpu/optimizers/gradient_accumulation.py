"""Gradient accumulation as a Keras 3 optimizer wrapper, exact under
`tf.distribute`."""

from __future__ import annotations

import functools
import warnings
from typing import Any

from keras_mgpu._flavour import (
    check_flavour,
    keras_of,
    register_serializable,
    tf,
)
from keras_mgpu._validation import check_int
from keras_mgpu.distribute import strategy_kind
from keras_mgpu.optimizers._accumulation_common import (
    DENSE,
    INNER_ONLY_ARGUMENTS,
    MAXIMUM,
    SPARSE,
    AccumulationProtocol,
    AccumulatorSlot,
    all_finite,
    check_inner_is_not_a_wrapper,
    check_momentum_correction,
    deduplicate_rows,
    divide_gradient,
    overwrites_with_gradient,
    reject_wrapper_arguments,
    scatter_add_locally,
    touched_rows,
    variable_name,
)

# Keras 3 whatever TF_USE_LEGACY_KERAS says: this class serves Keras 3
# optimizers (keras_mgpu.GradientAccumulationOptimizer picks it for them).
keras = keras_of("keras3")

_INNER_ONLY_ARGUMENTS = INNER_ONLY_ARGUMENTS + (
    "loss_scale_factor",
    "gradient_accumulation_steps",
)


def _clip_like(optimizer: Any, grads: list) -> list:
    """Clip `grads` with `optimizer`'s `clipnorm` / `global_clipnorm` /
    `clipvalue` settings.

    Uses `BaseOptimizer._clip_gradients` (private in Keras 3.10-3.15) so the
    clipping maths is exactly Keras's own; only *when* it runs changes (on
    the reduced mean gradient instead of each replica's partial one).
    """
    return optimizer._clip_gradients(grads)


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


def _is_sparse(grad: Any) -> bool:
    return isinstance(grad, tf.IndexedSlices)


def _all_reduce_sum(context: Any, grads: list) -> list:
    """Sum `grads` over the replicas (replica context); repeated rows of
    sparse gradients, which the sum concatenates, are summed too."""
    reduced = context.all_reduce(tf.distribute.ReduceOp.SUM, grads)
    if context.num_replicas_in_sync == 1:
        return reduced
    return [deduplicate_rows(g) if _is_sparse(g) else g for g in reduced]


def _replica_share(context: Any, grad: Any) -> Any:
    """This replica's part of an all-reduced gradient, such that the
    inner optimizer's all-reduce (a sum) gives `grad` back: an equal share
    of a dense gradient; all rows of a sparse one on the first replica and
    none elsewhere, so each row reaches the inner optimizer once."""
    replicas = context.num_replicas_in_sync
    if not _is_sparse(grad):
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
    if _is_sparse(grad):
        return SPARSE
    return DENSE


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
    each replica's partial gradient under `MirroredStrategy`); that costs one
    extra all-reduce per update. Before an update, the wrapper checks that
    the reduced mean gradient is finite; if not, the whole window is
    skipped identically on every replica (`skipped_updates` counts them) and
    the accumulators restart from zero. That makes mixed precision
    (`LossScaleOptimizer`, which `compile` adds around this wrapper) safe
    under `MirroredStrategy`, where Keras decides "finite?" per replica.

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
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        accumulation_steps: int,
        name: str | None = None,
        momentum_correction: bool = False,
        **kwargs: Any,
    ) -> None:
        reject_wrapper_arguments(kwargs, _INNER_ONLY_ARGUMENTS)
        accumulation_steps = check_int(
            accumulation_steps, "accumulation_steps", minimum=1
        )
        self._check_inner(inner_optimizer)
        momentum_correction = check_momentum_correction(
            momentum_correction, inner_optimizer
        )
        super().__init__(learning_rate=0.0, name=name)
        self.momentum_correction = momentum_correction
        self.inner_optimizer = inner_optimizer
        self.accumulation_steps = accumulation_steps
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
        self.inner_optimizer.build(var_list)
        super().build(var_list)
        # The wrapper's own `_iterations` counts micro-steps.
        self._pending_steps = self.add_variable(
            shape=(),
            dtype="int64",
            aggregation="only_first_replica",
            name="pending_steps",
        )
        self._skipped_updates = self.add_variable(
            shape=(),
            dtype="int64",
            aggregation="only_first_replica",
            name="skipped_updates",
        )
        if self.momentum_correction:
            self._previous_learning_rate = self.add_variable(
                shape=(),
                dtype="float32",
                aggregation="only_first_replica",
                name="previous_learning_rate",
            )
        self._accumulators = [
            self._add_accumulator(variable) for variable in var_list
        ]
        # Under CentralStorageStrategy (and parameter servers) an `ON_READ`
        # variable is one `AggregatingVariable` on the parameter device:
        # replicas' writes are summed into it, so every replica reads the
        # global sum instead of its own part.
        self._accumulators_are_shared = bool(var_list) and not isinstance(
            self._accumulators[0].value, tf.distribute.DistributedValues
        )

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
        if isinstance(reference, keras.Variable):
            colocate = reference.value
        else:  # a raw tf.Variable, which plain Keras optimizers accept
            colocate = reference
        keeps_maximum = overwrites_with_gradient(reference)
        name = variable_name(reference).replace("/", "_") + "_accumulator"
        with self._distribution_strategy.extended.colocate_vars_with(colocate):
            with keras.name_scope(self.name, caller=self):
                variable = keras.Variable(
                    initializer="zeros",
                    shape=reference.shape,
                    dtype=reference.dtype,
                    trainable=False,
                    aggregation=(
                        "only_first_replica" if keeps_maximum else "sum"
                    ),
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
        raise NotImplementedError(
            "GradientAccumulationOptimizer supports the TensorFlow backend "
            "only, which has no stateless_apply."
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
        if not self.built:
            with keras.name_scope(self.name, caller=self):
                self.build(trainable_variables)
            self.built = True
        self._check_variables_are_known(trainable_variables)
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
        slots = [
            AccumulatorSlot(
                variable,
                self._accumulators[self._get_variable_index(variable)],
                _slot_kind(grad, variable),
            )
            for grad, variable in zip(grads, trainable_variables)
        ]
        with keras.name_scope(self.name, caller=self):
            self._accumulate(grads, slots)
            self._step(slots)

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

    def _decide(self, slots: list) -> tuple:
        """Replica context: (finite everywhere?, what the inner receives).

        The mean gradients come from `_reduce_means` (the update's one
        all-reduce happens there or in the inner optimizer). A variable Keras
        overwrites with its gradient gets the window's maximum, already the
        same on every replica, and no clipping or averaging.
        """
        summed = [slot for slot in slots if slot.kind != MAXIMUM]
        finite, means = self._reduce_means(summed)
        means = iter(means)
        grads = [
            tf.convert_to_tensor(slot.accumulator.value)
            if slot.kind == MAXIMUM
            else next(means)
            for slot in slots
        ]
        maxima = [g for g, slot in zip(grads, slots) if slot.kind == MAXIMUM]
        return tf.logical_and(finite, all_finite(maxima)), grads

    def _reduce_means(self, slots: list) -> tuple:
        """Replica context: (finite everywhere?, this replica's share of each
        mean gradient; the inner optimizer's all-reduce sums the shares).

        Without clipping each replica hands over its local mean, and the
        inner optimizer all-reduces it (one all-reduce per update); only a
        scalar "non-finite" count crosses devices beforehand. With clipping
        the means are all-reduced here, clipped, and handed over as shares
        that the inner's own sum restores (its own clipping is then a no-op:
        each share's norm is below the threshold). Sparse means under
        several replicas are always reduced here: tf.distribute sums slices
        by concatenating them, so the inner would see a row touched on two
        replicas twice, which Keras applies unsummed (Adagrad, RMSprop).
        """
        context = tf.distribute.get_replica_context()
        local = [self._local_mean(slot) for slot in slots]
        if _has_clipping(self.inner_optimizer):
            reduced = _all_reduce_sum(context, local)
            clipped = _clip_like(self.inner_optimizer, reduced)
            shares = [_replica_share(context, g) for g in clipped]
            return all_finite(reduced), shares
        sparse = [i for i, g in enumerate(local) if _is_sparse(g)]
        if sparse and context.num_replicas_in_sync > 1:
            reduced = _all_reduce_sum(context, [local[i] for i in sparse])
            for i, grad in zip(sparse, reduced):
                local[i] = _replica_share(context, grad)
        nonfinite = tf.cast(tf.logical_not(all_finite(local)), tf.float32)
        nonfinite = context.all_reduce(tf.distribute.ReduceOp.SUM, nonfinite)
        return tf.equal(nonfinite, 0.0), local

    def _apply_to_inner(self, grads: list, slots: list) -> None:
        """Replica context: one inner update, then empty the accumulators.

        Variables Keras overwrites with their gradient go to the inner
        optimizer too, with the window's maximum: its own `apply` assigns
        them, as without accumulation.
        """
        self.inner_optimizer.apply(grads, [slot.variable for slot in slots])
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
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects=None):
        config = dict(config)
        inner = keras.saving.deserialize_keras_object(
            config.pop("inner_optimizer"), custom_objects=custom_objects
        )
        return cls(inner, **config)

"""Gradient accumulation as a tf_keras optimizer wrapper, exact under
`tf.distribute` (the `TF_USE_LEGACY_KERAS=1` flavour, for TFMOT users)."""

from __future__ import annotations

import functools
import warnings
from typing import Any

import numpy as np

from keras_mgpu import compression as compression_lib
from keras_mgpu._flavour import (
    check_flavour,
    keras_of,
    register_serializable,
    tf,
)
from keras_mgpu.normalization._warn import check_from_optimizer
from keras_mgpu.optimizers._accumulation_common import (
    DENSE,
    INNER_ONLY_ARGUMENTS,
    SPARSE,
    AccumulationProtocol,
    AccumulatorSlot,
    all_finite,
    assign_compression_state,
    check_inner_is_not_a_wrapper,
    divide_gradient,
    reduce_before_the_inner,
    scatter_add_locally,
    touched_rows,
)

# tf_keras whatever TF_USE_LEGACY_KERAS says: this class serves tf_keras
# optimizers (keras_mgpu.GradientAccumulationOptimizer picks it for them).
keras = keras_of("tf_keras")

_INNER_ONLY_ARGUMENTS = INNER_ONLY_ARGUMENTS + ("jit_compile", "mesh")


class _CallableList(list):
    """A list that can also be called, like tf_keras's `optimizer.variables`
    (which is both a property and, for old callers, a method)."""

    def __call__(self) -> list:
        return self


def _true_dtype(variable: Any) -> tf.DType:
    # Under a mixed precision policy, model variables report their compute
    # ("cast") dtype; accumulators keep the variable's storage dtype.
    return getattr(variable, "true_dtype", variable.dtype)


@functools.partial(register_serializable, flavour="tf_keras")
class GradientAccumulationOptimizer(
    AccumulationProtocol, keras.optimizers.Optimizer
):
    """Accumulates gradients over `accumulation_steps` micro-batches, then
    applies their mean with the inner optimizer (tf_keras flavour).

    This is the tf_keras (`TF_USE_LEGACY_KERAS=1`) build of
    `keras_mgpu.optimizers.GradientAccumulationOptimizer`, with the same
    public contract; `keras_mgpu` picks it when the tf_keras flavour is on.

    After `K = accumulation_steps` calls to `apply_gradients` on `R`
    replicas, the model variables equal those of one step of the inner
    optimizer on the concatenation of the `K·R` micro-batches (mean loss), to
    float rounding. That holds for every inner optimizer (SGD, momentum,
    Adam, AdamW, RMSprop, ...) because the inner optimizer runs exactly once
    per update, on the mean gradient: weight decay, clipping, EMA and
    learning-rate schedules act once per update, not per micro-batch.

    **Counters.** `iterations` is the inner optimizer's update counter (what
    schedules, EMA and `keras_mgpu` LR callbacks read). `micro_steps` counts
    every call to `apply_gradients`; `pending_steps` is the number of
    micro-batches accumulated in the current window (0 right after an
    update). Under `mixed_float16`, tf_keras's `LossScaleOptimizer` drops a
    micro-batch whose gradients overflow before it reaches this wrapper, and
    advances `iterations` by one, as it does for any optimizer.

    **Under `tf.distribute`.** Each replica adds its gradients to its own
    accumulators (`ON_READ` variables with `SUM` aggregation, local to the
    device: no communication). Once per window, the update decision is taken
    in cross-replica context and the inner optimizer's `apply_gradients`
    all-reduces the accumulated mean gradient once; tf_keras clips after that
    all-reduce, so clipping acts on the reduced mean gradient, as on one
    device. Before an update, the wrapper checks that the mean gradient is
    finite on every replica; if not, the whole window is skipped identically
    everywhere (`skipped_updates` counts them) and the accumulators restart
    from zero. Works under the default strategy, `OneDeviceStrategy`,
    `MirroredStrategy`, `CentralStorageStrategy`,
    `MultiWorkerMirroredStrategy` and `ParameterServerStrategy`
    (`model.fit` with a `DatasetCreator`). Under
    `ParameterServerStrategy` the accumulators live on the parameter servers
    and are shared by the workers: with one worker the equivalence above is
    exact; with several, workers step asynchronously (as in any
    parameter-server training) and a window holds the first `K`
    micro-batches that arrive.

    **State.** Accumulators and counters are optimizer variables, so
    `tf.train.Checkpoint`, `.keras` files and `BackupAndRestore` resume in
    the middle of an accumulation window. The accumulators are saved as the
    sum over replicas; restored, each replica holds an equal share, which
    gives the same update (even on a different number of replicas).

    **Sparse gradients** (`tf.IndexedSlices`, e.g. from `Embedding`) are
    scattered into the accumulator; at the update the inner optimizer
    receives the mean of the rows touched in the window as
    `tf.IndexedSlices` (unique indices, as tf_keras's own deduplication
    makes them), so it updates sparsely where it would without accumulation.
    **Non-trainable weights** (e.g. `BatchNormalization` statistics) keep
    updating on every micro-batch's forward pass, as with any Keras model;
    a model with trainable BatchNormalization and no choice made about it
    gets one `BatchNormMicroBatchWarning` (see the Keras 3 class).

    Args:
        inner_optimizer: A tf_keras `tf_keras.optimizers.Optimizer` (not a
            `tf_keras.optimizers.legacy` one) that applies the accumulated
            gradients. Its learning rate, weight decay, clipping and EMA
            settings are used once per update.
        accumulation_steps: int >= 1. Micro-batches per update.
        momentum_correction: bool (default False). With an SGD inner
            optimizer with momentum, rescale its velocity by
            `new_rate / previous_rate` when the learning rate changes
            (Goyal et al., 2017); see the Keras 3 class.
        compression: None (default), "float16", "bfloat16", a
            `keras_mgpu.compression.PowerSGD(rank=...)` or another
            `keras_mgpu.compression.GradientCompression`: how the window's
            mean gradient crosses devices and workers, once per update; see
            the Keras 3 class.
        name: Optional name. Defaults to "GradientAccumulationOptimizer".

    Example:

    ```python
    import os
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tf_keras
    from keras_mgpu.optimizers import GradientAccumulationOptimizer

    model = tf_keras.Sequential([tf_keras.layers.Dense(1, input_shape=(4,))])
    model.compile(
        optimizer=GradientAccumulationOptimizer(
            tf_keras.optimizers.Adam(1e-3), accumulation_steps=4
        ),
        loss="mse",
    )
    ```
    """

    _INNER_ONLY_ARGUMENTS = _INNER_ONLY_ARGUMENTS

    # The constructor is `AccumulationProtocol.__init__`; these are its
    # tf_keras hooks.
    def _drop_arguments(self, kwargs: dict) -> None:
        # Written by get_config so tf_keras's deserializer picks the new
        # optimizer classes; meaningless here.
        kwargs.pop("is_legacy_optimizer", None)

    def _init_base(self, name: str | None) -> None:
        keras.optimizers.Optimizer.__init__(
            self,
            name=name or "GradientAccumulationOptimizer",
            jit_compile=False,
        )

    def _take_over_from_inner(self, inner_optimizer: Any) -> None:
        self._accumulators: list = []

    @staticmethod
    def _check_inner(inner_optimizer: Any) -> None:
        check_flavour(inner_optimizer, "inner_optimizer", "tf_keras")
        check_inner_is_not_a_wrapper(
            inner_optimizer,
            GradientAccumulationOptimizer,
            keras.mixed_precision.LossScaleOptimizer,
        )
        if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
            raise TypeError(
                "Argument `inner_optimizer` must be a tf_keras "
                "`tf_keras.optimizers.Optimizer` instance (e.g. "
                "`tf_keras.optimizers.SGD`, not a "
                "`tf_keras.optimizers.legacy` optimizer). Received: "
                f"inner_optimizer={inner_optimizer!r} (of type "
                f"{type(inner_optimizer).__name__})"
            )

    # ------------------------------------------------------------------
    # State
    # ------------------------------------------------------------------
    def build(self, var_list: list) -> None:
        if getattr(self, "_built", False):
            return
        var_list = list(var_list)
        # The base build would create EMA variables for a `use_ema` that
        # reads the inner's; the inner's own update keeps the averages.
        self._building_own_state = True
        try:
            super().build(var_list)
        finally:
            self._building_own_state = False
        self.inner_optimizer.build(var_list)
        # The wrapper's own `_iterations` (created by the base class) counts
        # micro-steps; these two count within and across windows.
        self._pending_steps = self.add_variable(
            shape=(), dtype=tf.int64, name="pending_steps"
        )
        self._skipped_updates = self.add_variable(
            shape=(), dtype=tf.int64, name="skipped_updates"
        )
        if self.momentum_correction:
            self._previous_learning_rate = self.add_variable(
                shape=(), dtype=tf.float32, name="previous_learning_rate"
            )
        self._add_slots(var_list)
        self._built = True

    def _ema_pair(self, variable: Any) -> tuple | None:
        # tf_keras starts the averages at the weights (`initial_value`);
        # the micro-steps before the first update keep them there.
        inner = self.inner_optimizer
        index = inner._index_dict[inner._var_key(variable)]
        return variable, inner._model_variables_moving_average[index]

    def _add_accumulator(self, reference: Any) -> tf.Variable:
        """One replica-local accumulator shaped like `reference`.

        `ON_READ` + `SUM`: writes in replica context stay on the replica's
        device; a read in cross-replica context (saving) sums the replicas,
        and a restore splits the sum evenly, so the total is preserved.
        `CentralStorageStrategy` and `ParameterServerStrategy` make it one
        variable next to `reference` instead, to which every replica's
        `assign_add` is summed.
        """
        name = reference.name.split(":")[0].replace("/", "_")
        return self._add_replica_local(
            reference, f"accumulator/{name}", reference.shape, per_replica=True
        )

    def _slot_prefix(self, reference: Any) -> str:
        name = reference.name.split(":")[0].replace("/", "_")
        return f"compression/{name}"

    def _add_replica_local(
        self,
        reference: Any,
        name: str,
        shape: Any,
        per_replica: bool,
        initial_value: Any = None,
    ) -> tf.Variable:
        """An `ON_READ` optimizer variable beside `reference`, written by
        each replica in replica context: `per_replica` values are summed
        when saved and split when restored (`SUM`); others are the same on
        every replica (`ONLY_FIRST_REPLICA`)."""
        strategy = tf.distribute.get_strategy()
        dtype = _true_dtype(reference)
        if initial_value is None:
            initial = tf.zeros(shape, dtype=dtype)
        else:
            initial = tf.constant(initial_value(), dtype=dtype)
        aggregation = (
            tf.VariableAggregation.SUM
            if per_replica
            else tf.VariableAggregation.ONLY_FIRST_REPLICA
        )
        with strategy.extended.colocate_vars_with(reference):
            variable = tf.Variable(
                initial,
                name=name,
                trainable=False,
                synchronization=tf.VariableSynchronization.ON_READ,
                aggregation=aggregation,
            )
        self._variables.append(variable)
        return variable

    @property
    def variables(self) -> list:
        """The wrapper's variables, then the inner optimizer's."""
        return _CallableList(
            list(self._variables) + list(self.inner_optimizer.variables)
        )

    @AccumulationProtocol.iterations.setter
    def iterations(self, variable: tf.Variable) -> None:
        # tf_keras assigns `optimizer.iterations` when restoring.
        self.inner_optimizer.iterations = variable

    def load_own_variables(self, store: Any) -> None:
        """Load the state saved in a `.keras` file.

        As tf_keras's own, but reads each array first: assigning to an
        `ON_READ` accumulator in cross-replica context divides the value by
        the replica count, which an h5py dataset does not support.
        """
        variables = self.variables
        if len(store.keys()) != len(variables):
            warnings.warn(
                f"Skipping variable loading for optimizer '{self.name}': "
                f"it has {len(variables)} variables whereas the saved "
                f"optimizer has {len(store.keys())}.",
                stacklevel=2,
            )
            return
        for index, variable in enumerate(variables):
            variable.assign(np.asarray(store[str(index)]))

    # ------------------------------------------------------------------
    # Applying gradients
    # ------------------------------------------------------------------
    def apply_gradients(
        self,
        grads_and_vars,
        name: str | None = None,
        skip_gradients_aggregation: bool = False,
        **kwargs: Any,
    ) -> tf.Variable:
        """Add one micro-batch's gradients; update once per window.

        `skip_gradients_aggregation=True` means the gradients are already
        summed over replicas (tf_keras's `LossScaleOptimizer` passes them
        so); they are then accumulated as each replica's share of the sum.
        """
        aggregate = kwargs.pop("experimental_aggregate_gradients", True)
        if kwargs:
            raise TypeError(
                "apply_gradients() got unexpected arguments: "
                f"{', '.join(sorted(kwargs))}."
            )
        pre_reduced = skip_gradients_aggregation or not aggregate
        pairs = [(g, v) for g, v in grads_and_vars]
        if not pairs:
            return self.iterations
        variables = [v for _, v in pairs]
        # The model's `train_step` is on the stack (BatchNormalization
        # warning, once; a dictionary lookup afterwards).
        check_from_optimizer(self, variables)
        with tf.init_scope():
            # Lift variable creation out of any tf.function, as tf_keras
            # optimizers do.
            self.build(variables)
        pairs = [(g, v) for g, v in pairs if g is not None]
        if not pairs:
            raise ValueError(
                "No gradients provided for any variable: "
                f"{[v.name for v in variables]}."
            )
        if tf.distribute.in_cross_replica_context():
            raise ValueError(
                "GradientAccumulationOptimizer.apply_gradients() must be "
                "called in a replica context (inside `strategy.run` or "
                "`model.fit`)."
            )
        slots = self._slots(pairs)
        with tf.name_scope(name or self.name):
            self._accumulate([g for g, _ in pairs], slots, pre_reduced)
            self._step(slots)
        return self.iterations

    def _slots(self, pairs: list) -> list:
        """The accumulator slot of each (gradient, variable) pair."""
        slots = []
        for grad, variable in pairs:
            index = self._index_dict.get(self._var_key(variable))
            if index is None:
                raise ValueError(
                    f"Variable {variable.name} is not among the variables "
                    "this optimizer was built with. Build it with every "
                    "variable it will update (`model.compile` and "
                    "`model.fit` do that)."
                )
            kind = SPARSE if isinstance(grad, tf.IndexedSlices) else DENSE
            slots.append(
                AccumulatorSlot(
                    variable,
                    self._accumulators[index],
                    kind,
                    self._compression_states[index],
                )
            )
        return slots

    def _accumulate(self, grads: list, slots: list, pre_reduced: bool) -> None:
        """Add this replica's gradients to its own accumulators (local)."""
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        for grad, slot in zip(grads, slots, strict=True):
            grad = tf.cast(grad, slot.accumulator.dtype)
            if pre_reduced and replicas > 1:
                # Keep "the sum over replicas is the global gradient sum".
                grad = divide_gradient(grad, replicas)
            if isinstance(grad, tf.IndexedSlices):
                # Only the looked-up rows are written.
                scatter_add_locally(slot.accumulator, grad)
            else:
                slot.accumulator.assign_add(grad)

    def _decide(self, slots: list, compress: bool = True) -> tuple:
        """Replica context: (finite everywhere?, (what this replica hands
        the inner optimizer, the new compression state)).

        Without compression each replica hands over its share (the shares
        sum, over replicas, to the mean gradient of the window; for a sparse
        slot: the mean of the rows touched on this replica); the inner
        optimizer all-reduces them (SUM: Keras scaled the loss by
        1/replicas) and clips the reduced result. Only a scalar crosses
        devices here. With compression under several replicas the mean is
        all-reduced here, compressed (unless `compress` is False, before a
        delayed method starts), and every replica hands the whole mean to
        the inner optimizer with `skip_gradients_aggregation=True`.
        """
        context = tf.distribute.get_replica_context()
        local = [self._local_mean(slot) for slot in slots]
        if self._reduces_before_the_inner():
            compression = self.compression if compress else None
            finite, means, state_values = reduce_before_the_inner(
                context, local, slots, compression
            )
            return finite, (means, state_values)
        nonfinite = tf.cast(tf.logical_not(all_finite(local)), tf.float32)
        nonfinite = context.all_reduce(tf.distribute.ReduceOp.SUM, nonfinite)
        return tf.equal(nonfinite, 0.0), (local, [()] * len(local))

    def _local_mean(self, slot: AccumulatorSlot) -> Any:
        """This replica's share of a slot's mean gradient."""
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        divisor = self.accumulation_steps
        if not isinstance(slot.accumulator, tf.distribute.DistributedValues):
            # One variable shared by the replicas (CentralStorageStrategy
            # and ParameterServerStrategy make the ON_READ variable an
            # aggregating one): it holds the whole sum, and every replica
            # hands over an equal part of it.
            divisor *= replicas
        total = tf.identity(slot.accumulator.read_value())
        if slot.kind == SPARSE:
            return touched_rows(total, divisor)
        return total / divisor

    def _reduces_before_the_inner(self) -> bool:
        """Whether the update's all-reduce happens in the wrapper: with
        compression under several replicas (tf_keras clips after its own
        all-reduce, so clipping needs nothing from the wrapper)."""
        context = tf.distribute.get_replica_context()
        return context.num_replicas_in_sync > 1 and self.compression is not None

    def _apply_to_inner(self, payload: tuple, slots: list) -> None:
        """Replica context: one inner update, then empty the accumulators.
        The compression state computed for this update is written now (not
        for a skipped window)."""
        grads, state_values = payload
        assign_compression_state(slots, state_values)
        variables = [slot.variable for slot in slots]
        self.inner_optimizer.apply_gradients(
            zip(grads, variables, strict=True),
            skip_gradients_aggregation=self._reduces_before_the_inner(),
        )
        self._reset(slots)

    def _reset(self, slots: list) -> None:
        for slot in slots:
            accumulator = slot.accumulator
            accumulator.assign(tf.zeros_like(accumulator.read_value()))

    # ------------------------------------------------------------------
    # Serialization
    # ------------------------------------------------------------------
    def get_config(self) -> dict:
        return {
            "name": self.name,
            "inner_optimizer": keras.optimizers.serialize(self.inner_optimizer),
            "accumulation_steps": self.accumulation_steps,
            "momentum_correction": self.momentum_correction,
            "compression": compression_lib.serialize(self.compression),
            # Tells tf_keras's `optimizers.deserialize` this is a new-style
            # (v2.11+) optimizer.
            "is_legacy_optimizer": False,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects=None):
        config = dict(config)
        config.pop("is_legacy_optimizer", None)
        inner = config.pop("inner_optimizer")
        if isinstance(inner, dict):
            inner = keras.optimizers.deserialize(
                inner,
                custom_objects=custom_objects,
                use_legacy_optimizer=False,
            )
        return cls(inner, **config)

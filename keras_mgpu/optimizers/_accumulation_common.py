"""What the Keras 3 and tf_keras gradient-accumulation wrappers share.

The two flavours' optimizer base classes differ (Keras 3 `apply` and
`keras.Variable`s, tf_keras `apply_gradients` and `tf.Variable`s), but the
accumulation protocol under `tf.distribute` is one: count the micro-step,
decide in cross-replica context whether the window is complete, and re-enter
the replicas to hand the mean gradient to the inner optimizer once. That
protocol, the counters and the argument checks live here; each flavour module
supplies `_decide`, `_apply_to_inner` and `_reset`.
"""

from __future__ import annotations

from typing import Any

from keras_mgpu._flavour import keras, tf
from keras_mgpu._validation import check_bool

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


def all_finite(tensors: list) -> tf.Tensor:
    """A scalar bool: every element of every tensor is finite."""
    flags = [tf.reduce_all(tf.math.is_finite(t)) for t in tensors]
    return tf.reduce_all(tf.stack(flags)) if flags else tf.constant(True)


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
    if not isinstance(inner_optimizer, keras.optimizers.SGD) or not momentum:
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


class AccumulationProtocol:
    """Mixin: counters, pass-throughs and the per-micro-step protocol.

    The flavour class must set `inner_optimizer`, `accumulation_steps`,
    `_iterations` (micro-steps), `_pending_steps`, `_skipped_updates`,
    `_accumulators`, and implement, in replica context:
    - `_decide(accumulators) -> (finite, grads)`: whether the window's mean
      gradient is finite on every replica (identical everywhere), and this
      replica's share of the mean gradient for the inner optimizer;
    - `_apply_to_inner(grads, variables, accumulators)`: one inner update,
      then empty the accumulators;
    - `_reset(accumulators)`: empty the accumulators.
    """

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
    def learning_rate(self) -> Any:
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate: Any) -> None:
        self.inner_optimizer.learning_rate = learning_rate

    def finalize_variable_values(self, var_list: list) -> None:
        self.inner_optimizer.finalize_variable_values(var_list)

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

    def _step_in_replica_context(self, variables, accumulators) -> None:
        """No strategy (or one that never merges): all in replica context."""
        self._iterations.assign_add(1)
        self._pending_steps.assign_add(1)

        def update():
            finite, grads = self._decide(accumulators)

            def skip():
                self._skipped_updates.assign_add(1)
                self._reset(accumulators)

            def apply_update():
                self._correct_momentum()
                self._apply_to_inner(grads, variables, accumulators)

            tf.cond(finite, apply_update, skip)
            self._pending_steps.assign(0)

        tf.cond(self._window_complete(), update, lambda: None)

    def _step_in_cross_replica_context(
        self, distribution, variables, accumulators
    ) -> None:
        """Called through `merge_call`.

        The decision must be taken here, in cross-replica context:
        tf.distribute does not allow a `tf.cond` in replica context whose
        branch calls `merge_call`, which the inner optimizer's update does
        (the pattern of Keras's `LossScaleOptimizer`). Variables and
        accumulators reach the replica functions by closure: passed as
        arguments, `call_for_each_replica` would unwrap distributed
        variables to one device's component.
        """
        self._iterations.assign_add(1)
        self._pending_steps.assign_add(1)
        extended = distribution.extended

        def update():
            finite_per_replica, grads_per_replica = (
                extended.call_for_each_replica(
                    lambda: self._decide(accumulators)
                )
            )
            # Every replica computed the same flag from an all-reduce.
            finite = distribution.experimental_local_results(
                finite_per_replica
            )[0]

            def apply_update():
                self._correct_momentum()
                extended.call_for_each_replica(
                    lambda grads: self._apply_to_inner(
                        grads, variables, accumulators
                    ),
                    args=(grads_per_replica,),
                )

            def skip_update():
                self._skipped_updates.assign_add(1)
                extended.call_for_each_replica(
                    lambda: self._reset(accumulators)
                )

            tf.cond(finite, apply_update, skip_update)
            self._pending_steps.assign(0)

        tf.cond(self._window_complete(), update, lambda: None)

    def _step(self, variables, accumulators) -> None:
        """After this replica accumulated: count, and update if due."""
        if tf.__internal__.distribute.strategy_supports_no_merge_call():
            # No strategy at all, or XLA on all-GPU MirroredStrategy.
            self._step_in_replica_context(variables, accumulators)
        else:
            tf.distribute.get_replica_context().merge_call(
                lambda distribution: self._step_in_cross_replica_context(
                    distribution, variables, accumulators
                )
            )

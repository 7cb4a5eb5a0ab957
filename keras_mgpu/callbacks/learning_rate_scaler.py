"""Scales the learning rate with the global batch of the run (callback)."""

from __future__ import annotations

import logging
from typing import Any

from keras_mgpu import backend
from keras_mgpu._flavour import callback_bases
from keras_mgpu._validation import (
    check_at_most_one,
    check_choice,
    check_int,
    reject_unknown,
    renamed_argument,
)
from keras_mgpu.distribute import (
    accumulation_steps_of,
    global_batch_size,
    num_replicas_in_sync,
    worker_info,
)
from keras_mgpu.schedules import _optimizer_lr
from keras_mgpu.schedules.scaling import SCALING_RULES, scaling_factor

logger = logging.getLogger("keras_mgpu")


class LearningRateScaler(*callback_bases()):
    """Multiplies the learning rate by the batch-size scaling rule, from the
    strategy and accumulation actually in use.

    At `on_train_begin` the callback derives the examples per update,
    `per-replica batch x replicas in sync (all workers) x accumulation
    steps` (`keras_mgpu.global_batch_size`, reading the model's strategy and
    optimizer), and multiplies the optimizer's learning rate, whatever it is
    (float, schedule, callable), by `global / base_batch_size` ("linear",
    Goyal et al. 2017) or its square root ("sqrt"). It says what it did
    once (logger `keras_mgpu`, and printed with `verbose=1`, on the chief).

    The factor is applied in-graph in front of the learning rate; the
    optimizer's own variable keeps the *base* rate, so checkpoints,
    `BackupAndRestore` backups and `model.save` (the wrapper is taken off at
    train end) hold the base rate, and resuming on a different number of
    replicas rescales correctly instead of scaling twice.
    `ReduceLROnPlateau` / `LearningRateScheduler` keep working: reading
    `optimizer.learning_rate` gives the scaled rate, and an assigned value
    is the scaled rate (the variable receives it divided by the factor).
    Works through `LossScaleOptimizer` and `GradientAccumulationOptimizer`.

    On JAX the replicas are the data-parallel size of the
    `keras.distribution` in force when `fit` runs (every device for
    `DataParallel`, the batch axis of a `ModelParallel` mesh, every
    process's devices; 1 without a distribution), and the factor is a
    number in the train step's state: a later `fit` with another factor
    (or a new `LearningRateScaler`) reuses the compiled step, as on
    TensorFlow, where it reuses the traced one.

    Keras's `fit` does not tell callbacks its batch size, so give either
    `batch_size` (the batch passed to `fit`: the global batch of one step,
    split across replicas) or `per_replica_batch_size`; a `batch_size` found
    in the callback params is used when both are None.

    Args:
        base_batch_size: int >= 1, the batch the learning rate was tuned for.
        batch_size: int >= 1 or None, the global batch of one step.
        per_replica_batch_size: int >= 1 or None, the batch of one replica.
        scaling_rule: "linear" (default) or "sqrt" (`rule` before 0.2:
            still accepted, with a `FutureWarning`, until 0.3).
        verbose: int, 0 (default, as Keras's callbacks) only logs the
            scaling (logger `keras_mgpu`); 1 also prints it once.

    Example (TensorFlow):

    ```python
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = make_model()
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    model.fit(x, y, batch_size=64 * strategy.num_replicas_in_sync,
              callbacks=[keras_mgpu.callbacks.LearningRateScaler(
                  base_batch_size=256, per_replica_batch_size=64)])
    ```

    Example (JAX, `KERAS_BACKEND=jax`):

    ```python
    distribution = keras.distribution.DataParallel()
    keras.distribution.set_distribution(distribution)
    model = make_model()
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    replicas = keras_mgpu.num_replicas_in_sync()  # every device
    model.fit(x, y, batch_size=64 * replicas,
              callbacks=[keras_mgpu.callbacks.LearningRateScaler(
                  base_batch_size=256, per_replica_batch_size=64)])
    ```
    """

    def __init__(
        self,
        base_batch_size: int,
        batch_size: int | None = None,
        per_replica_batch_size: int | None = None,
        *,
        scaling_rule: str = "linear",
        verbose: int = 0,
        **deprecated: Any,
    ) -> None:
        backend.require_backend("LearningRateScaler")
        super().__init__()
        scaling_rule = renamed_argument(
            "LearningRateScaler",
            deprecated,
            "rule",
            "scaling_rule",
            scaling_rule,
            "linear",
        )
        reject_unknown("LearningRateScaler", deprecated)
        self.base_batch_size = check_int(
            base_batch_size, "base_batch_size", minimum=1
        )
        self.batch_size = check_int(
            batch_size, "batch_size", minimum=1, allow_none=True
        )
        self.per_replica_batch_size = check_int(
            per_replica_batch_size,
            "per_replica_batch_size",
            minimum=1,
            allow_none=True,
        )
        check_at_most_one(
            ("batch_size", batch_size),
            ("per_replica_batch_size", per_replica_batch_size),
        )
        self.scaling_rule = check_choice(
            scaling_rule, "scaling_rule", SCALING_RULES
        )
        self.verbose = check_int(verbose, "verbose", minimum=0)
        self.factor: float | None = None
        self.global_batch_size: int | None = None
        self._wrapper: _optimizer_lr.ScaleWrapper | None = None
        self._reported: tuple | None = None

    def _strategy(self) -> Any:
        """The model's `tf.distribute` strategy; on JAX None, which the
        `keras_mgpu.distribute` helpers read as the `keras.distribution` in
        force (the one `fit` runs the step under)."""
        if backend.is_jax():
            return None
        return self.model.distribute_strategy

    def _examples_per_update(self) -> int:
        model = self.model
        strategy = self._strategy()
        optimizer = model.optimizer
        if self.per_replica_batch_size is not None:
            return global_batch_size(
                self.per_replica_batch_size, strategy, optimizer
            )
        batch = self.batch_size or (self.params or {}).get("batch_size")
        if not batch:
            raise ValueError(
                "LearningRateScaler needs the batch size: `fit` does not "
                "pass it to callbacks. Give `batch_size` (the batch passed "
                "to `fit`) or `per_replica_batch_size`."
            )
        return int(batch) * accumulation_steps_of(optimizer)

    def set_model(self, model) -> None:
        super().set_model(model)
        _optimizer_lr.prepare(model, "scale")

    def on_train_begin(self, logs: dict | None = None) -> None:
        examples = self._examples_per_update()
        factor = scaling_factor(
            examples, self.base_batch_size, scaling_rule=self.scaling_rule
        )
        self.global_batch_size, self.factor = examples, factor
        owner = _optimizer_lr.lr_owner(self.model.optimizer)

        def refresh(wrapper: _optimizer_lr.ScaleWrapper) -> None:
            # The new factor goes into its variable (`activate`): no retrace.
            wrapper.factor = factor

        self._wrapper = _optimizer_lr.install(
            owner,
            self._wrapper,
            reusable=lambda wrapper: wrapper.factor == factor,
            make=lambda top: _optimizer_lr.ScaleWrapper(
                owner, top, factor, model=self.model
            ),
            refresh=refresh,
        )
        _optimizer_lr.activate(self.model)
        self._report(examples, factor)

    def _report(self, examples: int, factor: float) -> None:
        report = (examples, factor, self.scaling_rule, self.base_batch_size)
        if report == self._reported:
            return
        self._reported = report
        strategy = self._strategy()
        message = (
            f"LearningRateScaler: {examples} examples per update "
            f"({num_replicas_in_sync(strategy)} replicas, "
            f"{accumulation_steps_of(self.model.optimizer)} accumulation "
            f"steps) vs. base batch {self.base_batch_size}: learning rate x "
            f"{factor:g} ({self.scaling_rule} rule), now "
            f"{_optimizer_lr.current_learning_rate(self.model.optimizer):g}."
        )
        logger.info(message)
        if self.verbose and worker_info(strategy)["is_chief"]:
            print(message)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        if logs is not None:
            # Keras's own LR callbacks may have logged it already (before
            # their change of the epoch): keep theirs, never log it twice.
            logs.setdefault(
                "learning_rate",
                _optimizer_lr.current_learning_rate(self.model.optimizer),
            )

    def on_train_end(self, logs: dict | None = None) -> None:
        _optimizer_lr.deactivate(self.model)

"""Gradual learning-rate warmup as a callback, exact in-graph."""

from __future__ import annotations

import math
import warnings

from keras_mgpu._flavour import callback_bases
from keras_mgpu._validation import check_int, check_number
from keras_mgpu.backend import require_backend
from keras_mgpu.distribute import accumulation_steps_of
from keras_mgpu.schedules import _optimizer_lr
from keras_mgpu.schedules.warmup import check_ramp


class LearningRateWarmup(*callback_bases()):
    """Ramps the optimizer's learning rate up over the first updates.

    At `on_train_begin` the callback puts an in-graph ramp in front of
    whatever learning rate the optimizer has (a float, a schedule, a
    callable): for update `n < warmup_steps` the learning rate is
    `ramp(initial_learning_rate -> lr(n))` at fraction `n / warmup_steps`,
    where `lr(n)` is what the optimizer would have used; from update
    `warmup_steps` on it is exactly `lr(n)` (a wrapped schedule keeps its own
    step count: unlike `keras_mgpu.schedules.Warmup`, nothing is shifted).

    The ramp reads the optimizer's update counter (`optimizer.iterations`;
    with `GradientAccumulationOptimizer` it counts updates, not
    micro-batches) inside the train step. It is therefore exact with
    `steps_per_execution > 1`, with gradient accumulation, and after a
    `BackupAndRestore` resume (the counter is restored), on every replica
    and worker of any `tf.distribute` strategy. On JAX the ramp is traced
    into the jitted train step and reads the optimizer's counter from the
    step's state, so it is as exact there, under no distribution,
    `DataParallel` and `ModelParallel`. It works through wrapper
    optimizers (`LossScaleOptimizer`, `GradientAccumulationOptimizer`) and
    with Keras's built-in `gradient_accumulation_steps` (whose
    `iterations` count updates).

    At `on_train_end` the original learning-rate object is put back, so
    `model.save()` writes a clean optimizer config. A later `fit` with this
    callback, or with a new `LearningRateWarmup` of the same `ramp` and
    other numbers, reuses the traced train function (no retrace on
    TensorFlow, no compilation on JAX): the ramp's length and start live in
    variables the step reads, not in the trace. On JAX those variables are
    optimizer state during `fit` (a jitted step reads nothing else), so a
    checkpoint Keras's own callbacks write *during* such a `fit`
    (`ModelCheckpoint`, Keras's `BackupAndRestore`) holds two (with
    `LearningRateScaler`, three) optimizer variables more than the
    optimizer has outside it; `keras_mgpu.callbacks.BackupAndRestore` and
    `model.save` after `fit` write the optimizer as Keras made it.

    **Other LR callbacks.** `ReduceLROnPlateau` and `LearningRateScheduler`
    assign `optimizer.learning_rate`: the assignment sets the target the
    ramp heads for (put them before or after this callback, the result is
    the same). Reading `optimizer.learning_rate` returns the ramped value,
    so during warmup a schedule that scales the *current* rate
    (`LearningRateScheduler(lambda epoch, lr: lr * 0.9)`) would read the
    ramped value: use a schedule of the epoch alone, or let warmup end
    first. With `LearningRateScaler`, list the scaler first (warmup then
    ramps to the scaled rate; the order of the two does not change the
    result either way).

    At each epoch end the current learning rate is written to the logs as
    `learning_rate` (History, CSVLogger and TensorBoard show it).

    Args:
        warmup_steps: int >= 1 or None, number of updates the ramp lasts.
        warmup_epochs: float > 0 or None, ramp length in epochs, converted
            with the steps per epoch of `fit` (divided by the accumulation
            steps). Exactly one of `warmup_steps` and `warmup_epochs`.
        initial_learning_rate: float >= 0, the learning rate of update 0.
            Defaults to 0.0.
        ramp: "linear" (default), "exponential" (needs
            `initial_learning_rate > 0`) or "cosine".
        verbose: int, 0 (default) silent, 1 prints the ramp at train begin
            and the learning rate at each epoch end during warmup.

    Example:

    ```python
    model.compile(optimizer=keras.optimizers.SGD(0.4), loss="mse")
    model.fit(x, y, epochs=10, callbacks=[
        keras_mgpu.callbacks.LearningRateWarmup(warmup_epochs=2),
    ])
    ```
    """

    def __init__(
        self,
        *,
        warmup_steps: int | None = None,
        warmup_epochs: float | None = None,
        initial_learning_rate: float = 0.0,
        ramp: str = "linear",
        verbose: int = 0,
    ) -> None:
        require_backend("LearningRateWarmup")
        super().__init__()
        if (warmup_steps is None) == (warmup_epochs is None):
            raise ValueError(
                "Pass exactly one of `warmup_steps` and `warmup_epochs`. "
                f"Received: warmup_steps={warmup_steps!r}, "
                f"warmup_epochs={warmup_epochs!r}"
            )
        self.warmup_steps = check_int(
            warmup_steps, "warmup_steps", minimum=1, allow_none=True
        )
        self.warmup_epochs = check_number(
            warmup_epochs,
            "warmup_epochs",
            minimum=0.0,
            exclusive_minimum=True,
            allow_none=True,
        )
        self.initial_learning_rate = check_number(
            initial_learning_rate, "initial_learning_rate", minimum=0.0
        )
        self.ramp = check_ramp(ramp, self.initial_learning_rate)
        self.verbose = check_int(verbose, "verbose", minimum=0)
        self._wrapper: _optimizer_lr.WarmupWrapper | None = None
        self._active_steps: int | None = None

    def _updates_per_epoch(self) -> float | None:
        steps = (self.params or {}).get("steps")
        if not steps:
            return None
        return steps / accumulation_steps_of(self.model.optimizer)

    def _resolve_steps(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        per_epoch = self._updates_per_epoch()
        if per_epoch is None:
            raise ValueError(
                "LearningRateWarmup(warmup_epochs=...) needs the number of "
                "steps per epoch, which `fit` does not know for this "
                "dataset. Pass `steps_per_epoch` to `fit`, or use "
                "`warmup_steps`."
            )
        return max(1, math.ceil(self.warmup_epochs * per_epoch))

    def set_model(self, model) -> None:
        super().set_model(model)
        _optimizer_lr.prepare(model, "warmup")

    def on_train_begin(self, logs: dict | None = None) -> None:
        steps = self._resolve_steps()
        self._active_steps = steps
        owner = _optimizer_lr.lr_owner(self.model.optimizer)
        per_epoch = self._updates_per_epoch()
        epochs = (self.params or {}).get("epochs")
        done = _optimizer_lr.update_count(owner)
        remaining = steps - done
        if per_epoch is not None and epochs and remaining > epochs * per_epoch:
            warnings.warn(
                f"LearningRateWarmup: warmup_steps={steps} is longer than "
                f"this training ({epochs} epochs of {per_epoch:g} updates); "
                "the learning rate will not reach its target.",
                stacklevel=2,
            )
        # Still installed from a fit that ended without train end: it stays.
        self._wrapper = _optimizer_lr.install(
            owner,
            self._wrapper,
            reusable=lambda wrapper: wrapper.warmup_steps == steps,
            make=lambda top: _optimizer_lr.WarmupWrapper(
                owner,
                top,
                steps,
                self.initial_learning_rate,
                self.ramp,
                model=self.model,
            ),
        )
        _optimizer_lr.activate(self.model)
        if self.verbose:
            print(
                f"LearningRateWarmup: {self.ramp} ramp from "
                f"{self.initial_learning_rate:g} over {steps} updates "
                f"(update {done} now)."
            )

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        lr = _optimizer_lr.current_learning_rate(self.model.optimizer)
        if logs is not None:
            # Keras's own LR callbacks may have logged it already (before
            # their change of the epoch): keep theirs, never log it twice.
            logs.setdefault("learning_rate", lr)
        if self.verbose and self._active_steps:
            done = _optimizer_lr.update_count(self.model.optimizer)
            if done <= self._active_steps:
                print(
                    f"\nEpoch {epoch + 1}: LearningRateWarmup learning rate "
                    f"{lr:.6g} (update {done} of {self._active_steps})."
                )

    def on_train_end(self, logs: dict | None = None) -> None:
        _optimizer_lr.deactivate(self.model)

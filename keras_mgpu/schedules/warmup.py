"""Gradual learning-rate warmup in front of any schedule, computed in-graph."""

from __future__ import annotations

import math
import numbers
from typing import Any

from keras_mgpu._flavour import (
    FLAVOUR,
    flavour_of,
    keras,
    keras_of,
    register_in_every_flavour,
    schedule_bases,
    tf,
)
from keras_mgpu._validation import check_choice, check_int, check_number

RAMPS = ("linear", "exponential", "cosine")


def check_ramp(ramp: str, initial_learning_rate: float) -> str:
    """Validate `ramp` against `initial_learning_rate` (shared with the
    warmup callback)."""
    check_choice(ramp, "ramp", RAMPS)
    if ramp == "exponential" and initial_learning_rate <= 0:
        raise ValueError(
            "Argument `initial_learning_rate` must be > 0 with "
            "ramp='exponential' (the ramp multiplies it geometrically). "
            f"Received: initial_learning_rate={initial_learning_rate!r}"
        )
    return ramp


def ramp_value(fraction: Any, initial: Any, target: Any, ramp: str) -> Any:
    """In-graph: the ramp from `initial` (fraction 0) to `target` (1).

    "linear": straight line; "cosine": half cosine (slow start and end);
    "exponential": geometric interpolation (needs `initial`, `target` > 0;
    a non-positive target gives `target`).
    """
    if ramp == "linear":
        return initial + (target - initial) * fraction
    if ramp == "cosine":
        weight = 0.5 * (1.0 - tf.cos(math.pi * fraction))
        return initial + (target - initial) * weight
    # Geometric: initial * (target / initial) ** fraction.
    safe_target = tf.maximum(target, tf.cast(1e-30, target.dtype))
    ratio = tf.math.log(safe_target / initial)
    return tf.where(target > 0, initial * tf.exp(ratio * fraction), target)


def is_schedule(value: Any) -> bool:
    """Whether `value` is a `LearningRateSchedule` of either flavour."""
    return isinstance(value, schedule_bases())


def _check_scalar_float(schedule: Any) -> None:
    """Evaluate `schedule(0)` eagerly: it must be a scalar float."""
    try:
        with tf.init_scope():
            value = tf.convert_to_tensor(
                schedule(tf.constant(0, dtype=tf.int64))
            )
    except Exception as exc:
        raise ValueError(
            "Argument `schedule` must return a scalar float learning rate "
            f"for an integer step. Received: schedule={schedule!r}, whose "
            f"schedule(0) raised {type(exc).__name__}: {exc}"
        ) from exc
    if value.shape.rank != 0 or not value.dtype.is_floating:
        raise ValueError(
            "Argument `schedule` must return a scalar float learning rate. "
            f"Received: schedule={schedule!r}, whose schedule(0) returned "
            f"dtype={value.dtype.name}, shape={value.shape.as_list()}"
        )


@register_in_every_flavour
class Warmup(*schedule_bases()):
    """Ramps the learning rate up over the first updates, then hands over to
    `schedule`.

    For `step < warmup_steps` the learning rate goes from
    `initial_learning_rate` (at step 0) towards the value `schedule` starts
    at, `schedule(0)`, following `ramp`. From step `warmup_steps` on, it is
    `schedule` shifted so that it starts at its own step 0:
    `Warmup(s, W)(W + t) == s(t)`. The linear ramp is
    `initial + (s(0) - initial) * step / W` (Goyal et al. 2017, and Keras's
    `CosineDecay(warmup_steps=...)`); "cosine" is a half cosine between the
    same end points; "exponential" interpolates geometrically (needs
    `initial_learning_rate > 0`).

    A `Warmup` is a learning-rate schedule of both Keras flavours (Keras 3
    and tf_keras optimizers accept it), and follows the flavour of the
    schedule it wraps when serialized.

    Everything is computed in-graph from the step the optimizer passes in,
    so it is exact inside `steps_per_execution`, after a resume (the step is
    the optimizer's restored counter), and with
    `keras_mgpu.GradientAccumulationOptimizer`, whose inner optimizer counts
    updates. Under `tf.distribute` every replica computes the same value
    from the same (mirrored) counter. Note that Keras's *built-in*
    `gradient_accumulation_steps` evaluates schedules on micro-steps.

    Args:
        schedule: float >= 0 or a `LearningRateSchedule` (e.g.
            `CosineDecay`, `PiecewiseConstantDecay`): the learning rate after
            warmup. Must return a scalar float.
        warmup_steps: int >= 1, number of updates the ramp lasts.
        initial_learning_rate: float >= 0, the learning rate at step 0.
            Defaults to 0.0.
        ramp: "linear" (default), "exponential" or "cosine".
        name: optional name, for the name scope of the ops.

    Example:

    ```python
    decay = keras.optimizers.schedules.CosineDecay(0.4, decay_steps=9000)
    lr = keras_mgpu.schedules.Warmup(decay, warmup_steps=1000)
    model.compile(optimizer=keras.optimizers.SGD(lr, momentum=0.9),
                  loss="mse")
    ```
    """

    def __init__(
        self,
        schedule: Any,
        warmup_steps: int,
        *,
        initial_learning_rate: float = 0.0,
        ramp: str = "linear",
        name: str | None = None,
    ) -> None:
        super().__init__()
        if isinstance(schedule, numbers.Real) and not isinstance(
            schedule, bool
        ):
            schedule = check_number(schedule, "schedule", minimum=0.0)
        elif is_schedule(schedule):
            _check_scalar_float(schedule)
        else:
            raise TypeError(
                "Argument `schedule` must be a float or a "
                "`keras.optimizers.schedules.LearningRateSchedule`. "
                f"Received: schedule={schedule!r} (of type "
                f"{type(schedule).__name__})"
            )
        self.schedule = schedule
        self.warmup_steps = check_int(warmup_steps, "warmup_steps", minimum=1)
        self.initial_learning_rate = check_number(
            initial_learning_rate, "initial_learning_rate", minimum=0.0
        )
        self.ramp = check_ramp(ramp, self.initial_learning_rate)
        if (
            self.ramp == "exponential"
            and isinstance(schedule, float)
            and schedule <= 0
        ):
            raise ValueError(
                "Argument `schedule` must be > 0 with ramp='exponential'. "
                f"Received: schedule={schedule!r}"
            )
        self.name = name

    def _evaluate(self, step: Any) -> Any:
        if isinstance(self.schedule, float):
            return tf.constant(self.schedule, dtype=keras.backend.floatx())
        return tf.convert_to_tensor(self.schedule(step))

    def __call__(self, step: Any) -> Any:
        with tf.name_scope(self.name or "Warmup"):
            step = tf.convert_to_tensor(step)
            # Hand the nested schedule its own step 0 at our step W, in the
            # step's own dtype (integer steps stay integer: boundaries of
            # PiecewiseConstantDecay compare exactly).
            warmup = tf.cast(self.warmup_steps, step.dtype)
            after = self._evaluate(
                tf.maximum(step - warmup, tf.zeros_like(step))
            )
            start = self._evaluate(tf.zeros_like(step))
            dtype = after.dtype
            float_step = tf.cast(step, dtype)
            fraction = tf.minimum(
                float_step / tf.cast(self.warmup_steps, dtype), 1.0
            )
            ramped = ramp_value(
                fraction,
                tf.cast(self.initial_learning_rate, dtype),
                tf.cast(start, dtype),
                self.ramp,
            )
            return tf.where(step < warmup, ramped, after)

    def get_config(self) -> dict:
        schedule = self.schedule
        config: dict = {}
        if not isinstance(schedule, float):
            flavour = flavour_of(schedule)
            schedule = keras_of(flavour).optimizers.schedules.serialize(
                schedule
            )
            config["flavour"] = flavour
        return {
            **config,
            "schedule": schedule,
            "warmup_steps": self.warmup_steps,
            "initial_learning_rate": self.initial_learning_rate,
            "ramp": self.ramp,
            "name": self.name,
        }

    @classmethod
    def from_config(cls, config: dict) -> Warmup:
        config = dict(config)
        flavour = config.pop("flavour", FLAVOUR)
        if isinstance(config["schedule"], dict):
            schedules = keras_of(flavour).optimizers.schedules
            config["schedule"] = schedules.deserialize(config["schedule"])
        return cls(**config)

"""Gradual learning-rate warmup in front of any schedule, computed in-graph.

The math is written once with Keras 3's `keras.ops`: on TensorFlow (Keras 3
and tf_keras, whose optimizers hand in TensorFlow tensors) they are
TensorFlow ops, on JAX they trace into the jitted train step.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from typing import Any

from keras_mgpu._flavour import (
    FLAVOUR,
    TF_RUNS,
    flavour_of,
    keras,
    keras_of,
    register_in_every_flavour,
    schedule_bases,
    tf,
)
from keras_mgpu._validation import check_choice, check_int, check_number
from keras_mgpu.backend import require_backend

RAMPS = ("linear", "exponential", "cosine")

#: Keras 3's backend ops. tf_keras has no `ops`; where it runs, Keras 3 runs
#: on TensorFlow too, so these are TensorFlow ops on TensorFlow tensors.
ops = keras_of("keras3").ops


def dtype_of(tensor: Any) -> str:
    """The dtype name of a tensor of any backend ("float32", "int64")."""
    return keras_of("keras3").backend.standardize_dtype(tensor.dtype)


def to_tensor(value: Any, dtype: str | None = None) -> Any:
    """A tensor of the running backend; a variable's value is read.

    TensorFlow's own conversion where TensorFlow runs: Keras 3's
    `convert_to_tensor` returns a `tf.Variable` (tf_keras's, a
    `MirroredVariable`) unread, as it counts as a tensor there.
    """
    if TF_RUNS:
        return tf.convert_to_tensor(value, dtype=dtype)
    return ops.convert_to_tensor(value, dtype=dtype)


def eager_scope() -> Any:
    """Outside any graph being traced: `tf.init_scope()` where TensorFlow
    runs (a `Warmup` may be built inside a `tf.function`); nothing to leave
    on JAX, where schedules are built outside `jit`."""
    return tf.init_scope() if TF_RUNS else contextlib.nullcontext()


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
        weight = 0.5 * (1.0 - ops.cos(math.pi * fraction))
        return initial + (target - initial) * weight
    # Geometric: initial * (target / initial) ** fraction.
    safe_target = ops.maximum(target, ops.cast(1e-30, dtype_of(target)))
    ratio = ops.log(safe_target / initial)
    return ops.where(target > 0, initial * ops.exp(ratio * fraction), target)


def is_schedule(value: Any) -> bool:
    """Whether `value` is a `LearningRateSchedule` of either flavour."""
    return isinstance(value, schedule_bases())


def _check_scalar_float(schedule: Any) -> None:
    """Evaluate `schedule(0)` eagerly: it must be a scalar float."""
    try:
        with eager_scope():
            step = ops.convert_to_tensor(0, dtype="int64" if TF_RUNS else None)
            value = to_tensor(schedule(step))
    except Exception as exc:
        raise ValueError(
            "Argument `schedule` must return a scalar float learning rate "
            f"for an integer step. Received: schedule={schedule!r}, whose "
            f"schedule(0) raised {type(exc).__name__}: {exc}"
        ) from exc
    dtype, shape = dtype_of(value), list(value.shape)
    if shape or not dtype.startswith(("float", "bfloat")):
        raise ValueError(
            "Argument `schedule` must return a scalar float learning rate. "
            f"Received: schedule={schedule!r}, whose schedule(0) returned "
            f"dtype={dtype}, shape={shape}"
        )


def _name_scope(name: str) -> Any:
    """A TensorFlow name scope for the ops where TensorFlow runs (graph
    readability); JAX's traced step has no use for one."""
    return tf.name_scope(name) if TF_RUNS else contextlib.nullcontext()


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

    Everything is computed in-graph (with `keras.ops`) from the step the
    optimizer passes in, so it is exact inside `steps_per_execution`, after
    a resume (the step is the optimizer's restored counter), and with
    `keras_mgpu.GradientAccumulationOptimizer`, whose inner optimizer counts
    updates. Under `tf.distribute` every replica computes the same value
    from the same (mirrored) counter. On JAX the schedule is traced into
    the jitted train step and evaluated on the optimizer's counter there,
    one value for the whole step, under no distribution, `DataParallel` and
    `ModelParallel` alike. Note that Keras's *built-in*
    `gradient_accumulation_steps` evaluates schedules on micro-steps (on
    both backends).

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
        require_backend("Warmup")
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
            return to_tensor(self.schedule, dtype=keras.backend.floatx())
        return to_tensor(self.schedule(step))

    def __call__(self, step: Any) -> Any:
        with _name_scope(self.name or "Warmup"):
            # A Keras variable (the optimizer's counter; on JAX its value in
            # the jitted step) or a tensor of either backend.
            step = to_tensor(step)
            step_dtype = dtype_of(step)
            # Hand the nested schedule its own step 0 at our step W, in the
            # step's own dtype (integer steps stay integer: boundaries of
            # PiecewiseConstantDecay compare exactly).
            warmup = ops.cast(self.warmup_steps, step_dtype)
            after = self._evaluate(
                ops.maximum(step - warmup, ops.zeros_like(step))
            )
            start = self._evaluate(ops.zeros_like(step))
            dtype = dtype_of(after)
            float_step = ops.cast(step, dtype)
            fraction = ops.minimum(
                float_step / ops.cast(self.warmup_steps, dtype), 1.0
            )
            ramped = ramp_value(
                fraction,
                ops.cast(self.initial_learning_rate, dtype),
                ops.cast(start, dtype),
                self.ramp,
            )
            return ops.where(step < warmup, ramped, after)

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

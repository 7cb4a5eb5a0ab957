"""In-graph learning-rate wrappers that callbacks install on an optimizer.

The LR callbacks (`LearningRateWarmup`, `LearningRateScaler`) must be exact
inside `steps_per_execution`, so the learning rate cannot be set from Python
between batches. Instead, at `on_train_begin` a callback puts a wrapper in
front of whatever learning-rate object the optimizer holds (a variable, a
schedule, a callable or another wrapper); the optimizer evaluates it in its
train step, from its own update counter. At `on_train_end` every wrapper is
taken off again, so the optimizer's config (and `model.save`) stays clean.

Assignments (`optimizer.learning_rate = 0.01`, as `ReduceLROnPlateau` and
`LearningRateScheduler` do) go *through* the wrappers to the variable below:
they set the target learning rate that warmup ramps to, and a scaler divides
them by its factor so that reading back gives what was written.

Retracing: the wrappers are traced into `model.train_function`. At train end
the traced function is put aside (keyed by the optimizer, the compile call
and the exact wrapper chain) and `model.train_function` is reset, so a later
`fit` without the callbacks retraces with the plain learning rate, while a
later `fit` with the same callbacks gets the traced function back (no
retrace).

Backends: the wrappers compute with `keras.ops`, so the same code runs in
TensorFlow's traced step and in JAX's jitted one. On JAX the optimizer's
variables (its counter and learning-rate variable) enter the jitted step as
state (`stateless_apply`); reading them there yields the traced values, so
the ramp follows the counter of every step and an assignment made between
epochs (`ReduceLROnPlateau`) reaches the next step through the state `fit`
reads back from the variables. Only tf_keras needs the wrappers converted
to tensors (it casts `optimizer.learning_rate` itself): that registration is
TensorFlow's, made where TensorFlow runs.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from keras_mgpu import backend
from keras_mgpu._flavour import TF_RUNS, flavour_of, keras, tf
from keras_mgpu.schedules.warmup import (
    dtype_of,
    is_schedule,
    ops,
    ramp_value,
    to_tensor,
)


def lr_owner(optimizer: Any) -> Any:
    """The optimizer that really holds the learning rate.

    Wrapper optimizers (`LossScaleOptimizer`, `GradientAccumulationOptimizer`)
    pass `learning_rate` and `iterations` through to `inner_optimizer`.
    """
    seen = set()
    while id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = getattr(optimizer, "inner_optimizer", None)
        if inner is None:
            break
        optimizer = inner
    return optimizer


def get_lr_object(owner: Any) -> Any:
    """The raw learning-rate object of `owner`.

    `_learning_rate` is private in Keras 3 (3.0-3.15) and tf_keras (2.11+
    optimizers); the public property evaluates it instead of returning it.
    """
    return owner._learning_rate


def set_lr_object(owner: Any, value: Any) -> None:
    """Replace the raw learning-rate object without the public setter.

    The setter would untrack the learning-rate variable (Keras 3.15), which
    changes the optimizer's variable list mid-training and breaks restoring
    `BackupAndRestore` backups; the variable stays tracked this way.
    """
    owner._learning_rate = value


def evaluate_lr(owner: Any, lr: Any) -> Any:
    """In-graph value of a learning-rate object, as `owner` would compute."""
    if isinstance(lr, LearningRateWrapper):
        return lr()
    if is_schedule(lr):
        # Keras 3 evaluates schedules on `_iterations`; so do we, to keep the
        # user's schedule exactly as it was.
        tf_keras = flavour_of(owner) == "tf_keras"
        step = owner.iterations if tf_keras else owner._iterations
        return to_tensor(lr(step))
    if isinstance(lr, (int, float)):
        return to_tensor(lr, dtype=keras.backend.floatx())
    if callable(lr) and not hasattr(lr, "assign"):
        return to_tensor(lr())
    return to_tensor(lr)


def chain(owner: Any) -> list:
    """The wrappers on `owner`, outermost first, then the object below."""
    links = [get_lr_object(owner)]
    while isinstance(links[-1], LearningRateWrapper):
        links.append(links[-1].inner)
    return links


def strip(owner: Any) -> None:
    """Take every wrapper off `owner`, restoring the original object."""
    set_lr_object(owner, chain(owner)[-1])


class LearningRateWrapper:
    """Base: a learning-rate callable wrapping `inner` on `owner`.

    Behaves enough like a variable for Keras's LR callbacks of both
    flavours: `assign`, `numpy`, `float()`, arithmetic and comparisons on
    the current value, and conversion to a tensor.
    """

    def __init__(self, owner: Any, inner: Any) -> None:
        self.owner = owner
        self.inner = inner

    def transform(self, target: Any) -> Any:
        raise NotImplementedError

    def __call__(self) -> Any:
        return self.transform(evaluate_lr(self.owner, self.inner))

    def assign_target(self, value: Any) -> None:
        """Set the learning rate below this wrapper's transformation."""
        inner = self.inner
        if isinstance(inner, LearningRateWrapper):
            inner.assign(value)
        elif is_schedule(inner) or not hasattr(inner, "assign"):
            raise TypeError(
                "This optimizer's learning rate is a "
                f"{type(inner).__name__}, hence it is not settable (e.g. by "
                "ReduceLROnPlateau or LearningRateScheduler). Create the "
                "optimizer with a float `learning_rate` to make it settable."
            )
        else:
            inner.assign(value)

    def assign(self, value: Any) -> None:
        self.assign_target(value)

    # Variable-like reading, for Python-side LR callbacks (eager).
    @property
    def dtype(self) -> Any:
        return self().dtype

    def numpy(self) -> np.ndarray:
        return np.asarray(ops.convert_to_numpy(self()))

    def __float__(self) -> float:
        return float(self.numpy())

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.asarray(self.numpy(), dtype=dtype)

    def __mul__(self, other):
        return float(self) * other

    __rmul__ = __mul__

    def __truediv__(self, other):
        return float(self) / other

    def __lt__(self, other):
        return float(self) < other

    def __le__(self, other):
        return float(self) <= other

    def __gt__(self, other):
        return float(self) > other

    def __ge__(self, other):
        return float(self) >= other

    def __repr__(self) -> str:
        return f"<{type(self).__name__} wrapping {self.inner!r}>"


def _convert(value, dtype=None, name=None, as_ref=False):
    tensor = value()
    return tf.cast(tensor, dtype) if dtype is not None else tensor


# tf_keras optimizers cast `self.learning_rate` (our object) to a tensor.
if TF_RUNS:
    tf.register_tensor_conversion_function(LearningRateWrapper, _convert)


class ScaleWrapper(LearningRateWrapper):
    """`factor * inner`; assigning `v` stores `v / factor` below."""

    def __init__(self, owner: Any, inner: Any, factor: float) -> None:
        super().__init__(owner, inner)
        self.factor = float(factor)

    def transform(self, target: Any) -> Any:
        return target * ops.cast(self.factor, dtype_of(target))

    def assign(self, value: Any) -> None:
        self.assign_target(np.asarray(value, dtype="float64") / self.factor)


class WarmupWrapper(LearningRateWrapper):
    """Ramps from `initial` towards `inner` over the first `warmup_steps`
    updates of `owner.iterations`, then returns `inner` unchanged."""

    def __init__(
        self,
        owner: Any,
        inner: Any,
        warmup_steps: int,
        initial_learning_rate: float,
        ramp: str,
    ) -> None:
        super().__init__(owner, inner)
        self.warmup_steps = int(warmup_steps)
        self.initial_learning_rate = float(initial_learning_rate)
        self.ramp = ramp

    def transform(self, target: Any) -> Any:
        dtype = dtype_of(target)
        step = ops.cast(to_tensor(self.owner.iterations), dtype)
        warmup = ops.cast(self.warmup_steps, dtype)
        fraction = ops.minimum(step / warmup, 1.0)
        ramped = ramp_value(
            fraction,
            ops.cast(self.initial_learning_rate, dtype),
            target,
            self.ramp,
        )
        return ops.where(step < warmup, ramped, target)


def learning_rate_tensor(optimizer: Any) -> Any:
    """The learning rate of `optimizer`'s next update, as a tensor (usable
    in-graph): its wrappers and schedules evaluated at its update count."""
    owner = lr_owner(optimizer)
    return evaluate_lr(owner, get_lr_object(owner))


def update_count(optimizer: Any) -> int:
    """Updates `optimizer` has applied (`iterations` of the optimizer that
    holds the learning rate), as a Python int; eager, like
    `current_learning_rate`. Keras's built-in accumulation makes
    `iterations` a tensor (micro-steps // steps), hence `convert_to_numpy`.
    """
    # Through a tensor: `np.array` refuses tf.distribute's MirroredVariable.
    return int(ops.convert_to_numpy(to_tensor(lr_owner(optimizer).iterations)))


def current_learning_rate(optimizer: Any) -> float:
    """The learning rate of `optimizer`'s next update, as a Python float.

    Eager: on JAX inside `fit`, the optimizer's variables hold their values
    at epoch boundaries and in `on_train_begin`/`on_train_end` (Keras moves
    them into the jitted step's state in between).
    """
    return float(ops.convert_to_numpy(learning_rate_tensor(optimizer)))


# ----------------------------------------------------------------------
# Traced train functions, kept per model across `fit` calls.
# ----------------------------------------------------------------------
_TRACED_ATTRIBUTE = "_keras_mgpu_lr_traced"


class _TracedEntry:
    """A train function and the wrapper chain it was traced with.

    A plain object on purpose: Keras's saving walks the model's attributes
    and would save a tuple or list holding the optimizer.
    """

    def __init__(self, key: tuple, function: Any) -> None:
        self.key = key
        self.function = function


def _trace_key(model: Any) -> tuple:
    owner = lr_owner(model.optimizer)
    # `_compile_config` is a new object at every `compile()` (Keras 3 and
    # tf_keras), which also resets the train function.
    compiled = getattr(model, "_compile_config", None)
    return (model.optimizer, compiled, owner, *chain(owner))


def _same(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))


def activate(model: Any) -> None:
    """Make `model.train_function` one traced with the current wrappers.

    Called at `on_train_begin`, after `fit` has made its train function.
    """
    entry = getattr(model, _TRACED_ATTRIBUTE, None)
    if entry is not None and _same(entry.key, _trace_key(model)):
        model.train_function = entry.function
    else:
        retrace(model)


def retrace(model: Any) -> None:
    """Give `model` a fresh train function, traced (on its first call) with
    the wrappers installed now."""
    if backend.is_jax():
        # JAX would hand back an earlier trace of an equal function.
        from keras_mgpu.backend.jax.train_function import (
            fresh_train_function,
        )

        fresh_train_function(model)
    else:
        model.make_train_function(force=True)


def deactivate(model: Any) -> None:
    """Put the traced train function aside and take the wrappers off.

    Called at `on_train_end`; idempotent, so every LR callback may call it.
    """
    if model.train_function is not None:
        # `object.__setattr__`: no tracking by Keras's attribute hooks.
        object.__setattr__(
            model,
            _TRACED_ATTRIBUTE,
            _TracedEntry(_trace_key(model), model.train_function),
        )
        model.train_function = None
    strip(lr_owner(model.optimizer))

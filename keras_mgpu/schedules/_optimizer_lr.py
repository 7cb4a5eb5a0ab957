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

Retracing: the wrappers are traced into `model.train_function`, but their
numbers (a factor, a ramp's length and start) are not: each wrapper reads
them from variables of its own slot on the optimizer (`LRState`), which
`activate` assigns. At train end the traced function is put aside (keyed by
the optimizer, the compile call and the *structure* of the wrapper chain:
kinds, ramps, the object below) and `model.train_function` is reset, so a
later `fit` without the callbacks retraces with the plain learning rate,
while a later `fit` with callbacks of the same kinds, whatever their numbers
and however often they are created afresh, gets the traced function back (no
retrace on TensorFlow, no compilation on JAX).

Backends: the wrappers compute with `keras.ops`, so the same code runs in
TensorFlow's traced step and in JAX's jitted one. On JAX the optimizer's
variables (its counter and learning-rate variable) enter the jitted step as
state (`stateless_apply`); reading them there yields the traced values, so
the ramp follows the counter of every step and an assignment made between
epochs (`ReduceLROnPlateau`) reaches the next step through the state `fit`
reads back from the variables. The wrappers' own variables join the
optimizer's variable list for the `fit` (`prepare` at the callbacks'
`set_model`, `activate`; a JAX step sees only its state) and leave it at
train end, so saved optimizers stay as Keras
makes them; `hidden_state` takes them out around a save or load made
during `fit` (BackupAndRestore). On TensorFlow a traced function reads a
variable by reference: they never join the list there.

Only tf_keras needs the wrappers converted to tensors (it casts
`optimizer.learning_rate` itself): that registration is TensorFlow's, made
where TensorFlow runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
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


def install(
    owner: Any,
    wrapper: Any,
    reusable: Callable[[Any], bool],
    make: Callable[[Any], Any],
    refresh: Callable[[Any], None] | None = None,
) -> Any:
    """Put a callback's learning-rate wrapper on `owner` at train begin,
    reusing the callback's previous one (`wrapper`, None at the first fit)
    where that keeps the traced step valid; returns the wrapper in force.

    Still in the chain (a fit that ended without train end): it stays, and
    `refresh` updates its numbers (its variables, no retrace). Detached but
    wrapping the same object of the same owner and `reusable`: put back as
    it is. Otherwise `make(inner)` builds a new one around the current
    learning-rate object.
    """
    top = get_lr_object(owner)
    if wrapper is not None and any(link is wrapper for link in chain(owner)):
        if refresh is not None:
            refresh(wrapper)
        return wrapper
    if not (
        wrapper is not None
        and wrapper.owner is owner
        and wrapper.inner is top
        and reusable(wrapper)
    ):
        wrapper = make(top)
    set_lr_object(owner, wrapper)
    return wrapper


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
    """Take every wrapper off `owner`, restoring the original object (and
    its variable list, see `hidden_state`)."""
    set_lr_object(owner, chain(owner)[-1])
    _leave_optimizer_variables(owner)


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


# ----------------------------------------------------------------------
# The wrappers' numbers, in variables (not constants of the trace).
# ----------------------------------------------------------------------
_STATE_ATTRIBUTE = "_keras_mgpu_lr_state"


class LRState:
    """Per optimizer: one slot of variables per wrapper position (a kind and
    how many wrappers of that kind lie below), created once and reused by
    every later wrapper at that position, so that a later `fit`'s wrappers
    read the very variables the kept trace reads.

    A plain object on purpose (no tracking by Keras or `tf.Module`)."""

    def __init__(self) -> None:
        self.slots: dict[tuple, dict[str, Any]] = {}

    def variables(self) -> list:
        return [v for slot in self.slots.values() for v in slot.values()]


def _float_dtype() -> str:
    """float64 where the backend keeps it (TensorFlow; JAX with x64), so a
    Python float cast to the learning rate's dtype in-graph rounds exactly
    as the constant did."""
    if TF_RUNS:
        return "float64"
    import jax

    return "float64" if jax.config.jax_enable_x64 else "float32"


def _new_variable(model: Any, name: str, dtype: str) -> Any:
    if TF_RUNS:
        # Under the model's strategy: a mirrored variable every replica
        # reads (created alike by every worker, at `on_train_begin`).
        strategy = getattr(model, "distribute_strategy", None)
        scope = strategy.scope() if strategy is not None else _no_scope()
        with tf.init_scope(), scope:
            return tf.Variable(
                tf.zeros((), dtype=dtype), trainable=False, name=name
            )
    # JAX: the distribution in force lays it out (replicated), as the
    # optimizer's own variables.
    return keras.Variable(
        np.zeros((), dtype=dtype), dtype=dtype, trainable=False, name=name
    )


class _no_scope:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> bool:
        return False


def state_slot(
    owner: Any, kind: str, index: int, names: dict[str, str], model: Any
) -> dict[str, Any]:
    """The variables of slot `(kind, index)` on `owner` (created once)."""
    state = owner.__dict__.get(_STATE_ATTRIBUTE)
    if state is None:
        state = LRState()
        object.__setattr__(owner, _STATE_ATTRIBUTE, state)
    key = (kind, index)
    if key not in state.slots:
        state.slots[key] = {
            name: _new_variable(
                model, f"keras_mgpu_lr_{kind}{index}_{name}", dtype
            )
            for name, dtype in names.items()
        }
    return state.slots[key]


def _state_variables(owner: Any) -> list:
    state = owner.__dict__.get(_STATE_ATTRIBUTE)
    return [] if state is None else state.variables()


def _depth(inner: Any, kind: type) -> int:
    """How many `kind` wrappers lie in the chain from `inner` down."""
    depth = 0
    while isinstance(inner, LearningRateWrapper):
        depth += isinstance(inner, kind)
        inner = inner.inner
    return depth


def _read(variable: Any, dtype: str) -> Any:
    return ops.cast(to_tensor(variable), dtype)


class ScaleWrapper(LearningRateWrapper):
    """`factor * inner`; assigning `v` stores `v / factor` below. The factor
    is read in-graph from a variable of the optimizer's `LRState`."""

    def __init__(
        self, owner: Any, inner: Any, factor: float, model: Any = None
    ) -> None:
        super().__init__(owner, inner)
        self.factor = float(factor)
        self.index = _depth(inner, ScaleWrapper)
        self.state = state_slot(
            owner, "scale", self.index, self.state_names(), model
        )

    @staticmethod
    def state_names() -> dict[str, str]:
        return {"factor": _float_dtype()}

    def signature(self) -> tuple:
        return ("scale", self.index)

    def write_state(self) -> None:
        self.state["factor"].assign(self.factor)

    def transform(self, target: Any) -> Any:
        return target * _read(self.state["factor"], dtype_of(target))

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
        model: Any = None,
    ) -> None:
        super().__init__(owner, inner)
        self.warmup_steps = int(warmup_steps)
        self.initial_learning_rate = float(initial_learning_rate)
        self.ramp = ramp
        self.index = _depth(inner, WarmupWrapper)
        # The ramp's kind shapes the graph (a trace per kind); its length
        # and start are numbers in variables.
        self.state = state_slot(
            owner, "warmup", self.index, self.state_names(), model
        )

    @staticmethod
    def state_names() -> dict[str, str]:
        return {
            "steps": "int64" if TF_RUNS else "int32",
            "initial": _float_dtype(),
        }

    def signature(self) -> tuple:
        return ("warmup", self.index, self.ramp)

    def write_state(self) -> None:
        self.state["steps"].assign(self.warmup_steps)
        self.state["initial"].assign(self.initial_learning_rate)

    def transform(self, target: Any) -> Any:
        dtype = dtype_of(target)
        step = ops.cast(to_tensor(self.owner.iterations), dtype)
        warmup = _read(self.state["steps"], dtype)
        fraction = ops.minimum(step / warmup, 1.0)
        ramped = ramp_value(
            fraction, _read(self.state["initial"], dtype), target, self.ramp
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
_TRACED_ATTRIBUTE = "_keras_mgpu_lr_traced"  # the last one put aside
_CACHE_ATTRIBUTE = "_keras_mgpu_lr_functions"
# Train functions kept per model: one per wrapper structure met (and the
# plain one), so alternating `fit` calls with and without the callbacks
# (or with a scaler, then a warmup) retrace nothing.
_CACHE_SIZE = 8


class _TracedEntry:
    """A train function and the wrapper chain it was traced with.

    A plain object on purpose: Keras's saving walks the model's attributes
    and would save a tuple or list holding the optimizer.
    """

    def __init__(self, key: tuple, function: Any) -> None:
        self.key = key
        self.function = function


class _TracedCache:
    """The entries of one model, newest last, and the functions we made."""

    def __init__(self) -> None:
        self.entries: list[_TracedEntry] = []
        self.ours: list[Any] = []

    def find(self, key: tuple) -> Any:
        for entry in reversed(self.entries):
            if _same(entry.key, key):
                return entry.function
        return None

    def put(self, key: tuple, function: Any) -> _TracedEntry:
        self.entries = [e for e in self.entries if not _same(e.key, key)]
        entry = _TracedEntry(key, function)
        self.entries = [*self.entries, entry][-_CACHE_SIZE:]
        return entry

    def made_here(self, function: Any) -> bool:
        return any(function is f for f in self.ours) or any(
            function is e.function for e in self.entries
        )


def _cache(model: Any) -> _TracedCache:
    cache = model.__dict__.get(_CACHE_ATTRIBUTE)
    if cache is None:
        cache = _TracedCache()
        # `object.__setattr__`: no tracking by Keras's attribute hooks.
        object.__setattr__(model, _CACHE_ATTRIBUTE, cache)
    return cache


def _trace_key(model: Any) -> tuple:
    owner = lr_owner(model.optimizer)
    # `_compile_config` is a new object at every `compile()` (Keras 3 and
    # tf_keras), which also resets the train function.
    compiled = getattr(model, "_compile_config", None)
    links = chain(owner)
    # Objects compared by identity, then the wrappers' structure by value:
    # their numbers live in variables, not in the trace.
    objects = (model.optimizer, compiled, owner, links[-1])
    return objects, tuple(link.signature() for link in links[:-1])


def _same(a: tuple, b: tuple) -> bool:
    (objects_a, structure_a), (objects_b, structure_b) = a, b
    return (
        len(objects_a) == len(objects_b)
        and all(x is y for x, y in zip(objects_a, objects_b, strict=True))
        and structure_a == structure_b
    )


def activate(model: Any) -> None:
    """Make `model.train_function` one traced with wrappers of the current
    structure, after writing the current wrappers' numbers into their
    variables.

    Called at `on_train_begin`, after `fit` has made its train function.
    """
    owner = lr_owner(model.optimizer)
    links = chain(owner)
    for link in links[:-1]:
        link.write_state()
    if not TF_RUNS:
        _join_optimizer_variables(owner)
    cache = _cache(model)
    current = model.train_function
    if current is not None and not cache.made_here(current):
        # Keras's own function of this compile (made by `fit`, or kept
        # from a plain `fit`): traced, if at all, without wrappers.
        objects, _ = _trace_key(model)
        cache.put((objects, ()), current)
    function = cache.find(_trace_key(model))
    if function is not None:
        model.train_function = function
    else:
        retrace(model)
        cache.ours = [*cache.ours, model.train_function][-_CACHE_SIZE:]


def prepare(model: Any, kind: str) -> None:
    """JAX, at a callback's `set_model` (before any `on_train_begin`): the
    variables of the wrapper `kind` ("scale", "warmup") will install join
    the optimizer's list now, so that a backup Keras's own
    `BackupAndRestore` restores at `on_train_begin`, whatever the order of
    the callbacks, meets the variable list it was saved with (our
    `BackupAndRestore` saves without them, see `hidden_state`)."""
    optimizer = getattr(model, "optimizer", None)
    if TF_RUNS or optimizer is None:
        return
    owner = lr_owner(optimizer)
    wrapper = {"scale": ScaleWrapper, "warmup": WarmupWrapper}[kind]
    index = _depth(get_lr_object(owner), wrapper)
    state_slot(owner, kind, index, wrapper.state_names(), model)
    _join_optimizer_variables(owner)


def _join_optimizer_variables(owner: Any) -> None:
    """JAX: the wrappers' variables enter the jitted step as optimizer
    state (Keras hands the step `optimizer.variables`; a variable outside
    them would be a constant of the trace), at the end of the list."""
    held = owner._variables
    for variable in _state_variables(owner):
        if not any(variable is v for v in held):
            held.append(variable)


def _leave_optimizer_variables(owner: Any) -> list:
    """Take the wrappers' variables out of `owner`'s list; returns
    (position, variable) pairs for `_rejoin`."""
    ours = _state_variables(owner)
    held = getattr(owner, "_variables", None)
    if not ours or held is None:
        return []
    removed = [
        (i, v) for i, v in enumerate(held) if any(v is mine for mine in ours)
    ]
    for i, _ in reversed(removed):
        del held[i]
    return removed


@contextlib.contextmanager
def hidden_state(model: Any) -> Iterator[None]:
    """Around a save or load during `fit`: the optimizer's variable list as
    Keras made it (JAX adds the wrappers' variables for the `fit`), so
    backups match optimizers with or without our LR callbacks."""
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None or TF_RUNS:
        yield
        return
    owner = lr_owner(optimizer)
    removed = _leave_optimizer_variables(owner)
    try:
        yield
    finally:
        for i, variable in removed:
            owner._variables.insert(i, variable)


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
    """Put the traced train function aside, take the wrappers off and
    give the model back its plain train function when one is kept.

    Called at `on_train_end`; idempotent, so every LR callback may call it.
    """
    owner = lr_owner(model.optimizer)
    if len(chain(owner)) == 1:
        _leave_optimizer_variables(owner)
        return  # taken off already (another LR callback's train end)
    cache = _cache(model)
    if model.train_function is not None:
        entry = cache.put(_trace_key(model), model.train_function)
        # `object.__setattr__`: no tracking by Keras's attribute hooks.
        object.__setattr__(model, _TRACED_ATTRIBUTE, entry)
    strip(owner)
    # The plain function of this compile when one is kept, else a new one
    # at the next `fit`.
    model.train_function = cache.find(_trace_key(model))

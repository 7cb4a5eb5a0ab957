"""Replay Keras's own optimizer tests through GradientAccumulationOptimizer.

The installed `keras` wheel ships its optimizer tests (`*_test.py` under
`keras/src/optimizers/`, schedules included): golden values for every
optimizer, clipping, EMA, weight decay, loss scaling, sparse updates,
serialization. They are read from the installed package at test time, so a
new Keras brings its new oracles.

How a case runs through the wrapper with `K` micro-steps (`replay`):
- Every optimizer the case constructs (directly, through `optimizers.get`,
  deserialization or `compile`) becomes
  `GradientAccumulationOptimizer(that_optimizer, K)`. Wrappers themselves
  (`LossScaleOptimizer`, `MultiOptimizer`, ours) stay as they are, so
  `LossScaleOptimizer(SGD())` wraps our wrapper, as `compile` does under
  mixed precision, and a `MultiOptimizer`'s sub-optimizers are wrapped. An
  optimizer built with Keras's own `gradient_accumulation_steps=n` becomes
  the wrapper with `n * K` steps around the same optimizer without it.
- Each gradient the case applies reaches the wrapper as `K` micro-gradients
  whose mean is exactly that gradient (`g + c_k * (|g| + 1)`, the `c_k`
  summing to 0: large, so a wrapper that sums, updates per micro-step or
  clips per micro-step moves away from the golden values). For a variable
  Keras overwrites with its gradient (float8 scales), the micro-values'
  maximum is the gradient, the rule of Keras's own accumulation.
- A direct call of Keras's clipping hook (`optimizer._clip_gradients(g)`,
  the clipping oracles) returns what the wrapper's real update path makes of
  `g`: a fresh wrapper around `SGD(learning_rate=1)` with the same clipping
  settings applies `g` as `K` micro-gradients to zero variables, and the
  clipped gradient is minus the result.
- Attributes the wrapper does not have (the inner optimizer's
  hyperparameters, slots, helpers) are read from the inner optimizer, as
  `optimizer.inner_optimizer.<name>` would be.

`KNOWN_DIFFERENCES` lists the cases that cannot pass and why; the test
module marks them as strict xfails, so one that starts passing is reported.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import unittest
import warnings
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

from keras_mgpu._flavour import keras, tf
from keras_mgpu.optimizers import gradient_accumulation as _module
from keras_mgpu.optimizers.gradient_accumulation import (
    GradientAccumulationOptimizer,
)

ORACLE_PACKAGE = "keras.src.optimizers"

_VARIABLES_LAYOUT = (
    "asserts the number or order of `optimizer.variables`: the wrapper "
    "lists its own state first (micro-step counter, learning-rate slot, "
    "window counters, accumulators), then the inner optimizer's, as Keras's "
    "LossScaleOptimizer lists its own first (README, Gradient accumulation)"
)
_NOT_AN_INSTANCE = (
    "asserts the class (or the class-derived name) of the optimizer object: "
    "a wrapper is not an instance of its inner optimizer's class and is "
    "named after its own, as Keras's LossScaleOptimizer is"
)
_SPARSE_INSTRUMENTATION = (
    "the oracle records sparse writes by patching the `assign*` methods of "
    "the optimizer object it holds, special-casing only LossScaleOptimizer "
    "(whose inner it patches); through any other wrapper it cannot see the "
    "inner optimizer's sparse writes. test_sparse_updates_reach_the_inner "
    "checks the same expectations on the inner optimizer"
)
_BUILTIN_STATE = (
    "asserts the private state of Keras's own accumulation "
    "(`_accumulated_gradients`, `_iterations`), which the wrapper replaces; "
    "the updates themselves are checked by the weight-decay cases"
)

# Case id (module:Class.method, module relative to ORACLE_PACKAGE) -> why
# it cannot pass through the wrapper. The same at every K.
KNOWN_DIFFERENCES = {
    "sgd_test:SGDTest.test_single_step": _VARIABLES_LAYOUT,
    "optimizer_test:OptimizerTest."
    "test_setting_lr_to_callable_untracks_lr_var": _VARIABLES_LAYOUT,
    "schedules.learning_rate_schedule_test:TestFitLRSchedulesFlow."
    "test_fit_lr_correctness": _VARIABLES_LAYOUT,
    "optimizer_test:OptimizerTest.test_get_method": _NOT_AN_INSTANCE,
    "optimizer_test:OptimizerTest.test_optimizer_auto_naming": (
        _NOT_AN_INSTANCE
    ),
    "multi_optimizer_test:MultiOptimizerTest.test_serialization": (
        _NOT_AN_INSTANCE
    ),
    "multi_optimizer_test:MultiOptimizerTest."
    "test_tensorboard_logging_with_multi_optimizer": _NOT_AN_INSTANCE
    + " (the logged learning-rate key carries the sub-optimizer's name)",
    # test_swap_ema_weights_with_multi_optimizer passes since the wrapper
    # shows its inner's `use_ema` and averages (SwapEMAWeights reads them
    # on a MultiOptimizer's sub-optimizers).
    "optimizer_test:OptimizerTest.test_gradient_accumulation": _BUILTIN_STATE,
    "optimizer_test:OptimizerTest."
    "test_overwrite_with_gradient_with_gradient_accumulation": _BUILTIN_STATE,
}
for _name in (
    "adadelta",
    "adafactor",
    "adagrad",
    "loss_scale_optimizer_sgd",
    "rmsprop",
    "scatter_update",
    "sgd",
):
    KNOWN_DIFFERENCES[
        "optimizer_sparse_test:OptimizerSparseTest."
        f"test_sparse_gradients_{_name}"
    ] = _SPARSE_INSTRUMENTATION


def oracle_modules() -> list[str]:
    """The test modules the installed Keras ships for its optimizers."""
    package = importlib.import_module(ORACLE_PACKAGE)
    root = os.path.dirname(package.__file__)
    names = []
    for directory, _, files in os.walk(root):
        for file in files:
            if file.endswith("_test.py"):
                path = os.path.relpath(os.path.join(directory, file), root)
                names.append(path[: -len(".py")].replace(os.sep, "."))
    return sorted(names)


def oracle_cases(modules: list[str]) -> list[str]:
    """Case ids `module:Class.method` of every test in `modules`."""
    cases = []
    loader = unittest.TestLoader()
    for name in modules:
        with warnings.catch_warnings():
            # Keras's own pytest marks (`requires_trainable_backend`), which
            # its conftest registers and ours does not.
            warnings.simplefilter("ignore")
            module = importlib.import_module(f"{ORACLE_PACKAGE}.{name}")
        for suite in loader.loadTestsFromModule(module):
            for case in suite:
                cls = type(case).__name__
                cases.append(f"{name}:{cls}.{case._testMethodName}")
    return cases


def keras_skip_reason(case_id: str) -> str | None:
    """The reason of a `pytest.mark.skipif` Keras puts on the case (or its
    class) whose condition holds here, e.g. "Requires TF" on JAX: pytest
    honours it, `unittest`'s `debug()` would not."""
    name, qualified = case_id.split(":")
    cls_name, method = qualified.split(".")
    cls = getattr(importlib.import_module(f"{ORACLE_PACKAGE}.{name}"), cls_name)
    marks = [
        *getattr(cls, "pytestmark", []),
        *getattr(getattr(cls, method), "pytestmark", []),
    ]
    for mark in marks:
        if mark.name == "skipif" and mark.args and mark.args[0] is True:
            return mark.kwargs.get("reason", "skipif")
    return None


def make_case(case_id: str) -> unittest.TestCase:
    name, qualified = case_id.split(":")
    cls_name, method = qualified.split(".")
    module = importlib.import_module(f"{ORACLE_PACKAGE}.{name}")
    return getattr(module, cls_name)(method)


# ----------------------------------------------------------------------
# The replay
# ----------------------------------------------------------------------
class _Replay(threading.local):
    steps: int | None = None  # K while a case runs, else None
    building_inner: bool = False


_replay = _Replay()
_original_apply = GradientAccumulationOptimizer.apply
_original_from_config = GradientAccumulationOptimizer.from_config.__func__


@contextlib.contextmanager
def _plain_optimizers() -> Iterator[None]:
    """Optimizers constructed inside stay plain (inner optimizers)."""
    previous = _replay.building_inner
    _replay.building_inner = True
    try:
        yield
    finally:
        _replay.building_inner = previous


def _base_optimizer_class() -> type:
    # The TensorFlow-backend `keras.src.optimizers.Optimizer`, base of every
    # Keras 3 optimizer and of the wrapper.
    return importlib.import_module("keras.src.optimizers.optimizer").Optimizer


def _stays_plain(cls: type) -> bool:
    multi = importlib.import_module("keras.src.optimizers.multi_optimizer")
    wrappers = (
        GradientAccumulationOptimizer,
        keras.optimizers.LossScaleOptimizer,
        multi.MultiOptimizer,
    )
    # Base classes of the wrapper too: Python would call `__init__` again on
    # a returned wrapper that is an instance of the class being called.
    return issubclass(cls, wrappers) or issubclass(
        GradientAccumulationOptimizer, cls
    )


def _new_optimizer(cls: type, *args: Any, **kwargs: Any) -> Any:
    """`Optimizer.__new__` while a case runs: wrap what the case builds."""
    optimizer = object.__new__(cls)
    steps = _replay.steps
    if steps is None or _replay.building_inner or _stays_plain(cls):
        return optimizer
    builtin = kwargs.pop("gradient_accumulation_steps", None) or 1
    with _plain_optimizers():
        optimizer.__init__(*args, **kwargs)
    return GradientAccumulationOptimizer(optimizer, builtin * steps)


def _install_constructor_hook() -> None:
    """Route optimizer construction through `_new_optimizer`, for good.

    Installed once per process and inert outside `replay`: CPython cannot
    take a patched `__new__` back off a class (`object.__new__` then rejects
    the constructor's arguments), so it is never removed.
    """
    base = _base_optimizer_class()
    if base.__dict__.get("__new__") is not _new_optimizer:
        base.__new__ = _new_optimizer


def split_gradient(grad: Any, k: int, steps: int, keeps_maximum: bool) -> Any:
    """Micro-gradient `k` of `steps`: their mean (or, for a variable Keras
    overwrites with its gradient, their maximum) is `grad`."""
    if grad is None or steps == 1:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        values = split_gradient(grad.values, k, steps, keeps_maximum)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    grad = tf.convert_to_tensor(grad)
    spread = tf.abs(grad) + tf.ones_like(grad)
    if keeps_maximum:
        return grad if k == steps - 1 else grad - spread
    weights = [1.0] * (steps - 1) + [-(steps - 1.0)]
    return grad + tf.cast(weights[k], grad.dtype) * spread


def _split_apply(self, grads, trainable_variables=None):
    """The wrapper's `apply`, fed one oracle gradient as K micro-steps."""
    grads = list(grads)
    if trainable_variables is not None:
        trainable_variables = list(trainable_variables)
        variables = trainable_variables
    elif self.built:
        variables = self._trainable_variables
    else:
        variables = [None] * len(grads)
    steps = _replay.steps or 1
    for k in range(steps):
        micro = [
            split_gradient(
                g, k, steps, getattr(v, "overwrite_with_gradient", False)
            )
            for g, v in zip(grads, variables)
        ]
        _original_apply(self, micro, trainable_variables)


def _from_config(cls, config, custom_objects=None):
    with _plain_optimizers():
        return _original_from_config(cls, config, custom_objects)


def _clip_through_update(self, grads: list) -> list:
    """What the wrapper's real update path makes of `grads` (see module
    docstring)."""
    inner = self.inner_optimizer
    with _plain_optimizers():
        probe_inner = keras.optimizers.SGD(
            learning_rate=1.0,
            clipnorm=inner.clipnorm,
            global_clipnorm=inner.global_clipnorm,
            clipvalue=inner.clipvalue,
        )
    probe = GradientAccumulationOptimizer(probe_inner, _replay.steps or 1)
    # keras.ops, not tf: the replay runs on JAX too (K=1).
    grads = [keras.ops.convert_to_tensor(g, "float32") for g in grads]
    variables = [keras.Variable(keras.ops.zeros_like(g)) for g in grads]
    probe.apply(grads, variables)
    return [-keras.ops.convert_to_tensor(v) for v in variables]


def _inner_attribute(self, name: str) -> Any:
    inner = self.__dict__.get("inner_optimizer")
    if inner is None or name.startswith("__"):
        raise AttributeError(name)
    return getattr(inner, name)


@contextlib.contextmanager
def replaying(steps: int, breakage: dict | None = None) -> Iterator[None]:
    """Run the code inside as a replay with `steps` micro-steps per applied
    gradient. `breakage` maps wrapper method names to replacements (the
    deliberately broken wrappers)."""
    _install_constructor_hook()
    wrapper = GradientAccumulationOptimizer
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(wrapper, "apply", _split_apply))
        stack.enter_context(
            mock.patch.object(wrapper, "from_config", classmethod(_from_config))
        )
        stack.enter_context(
            mock.patch.object(wrapper, "_clip_gradients", _clip_through_update)
        )
        stack.enter_context(
            mock.patch.object(
                wrapper, "__getattr__", _inner_attribute, create=True
            )
        )
        for name, replacement in (breakage or {}).items():
            target = _module if name.startswith("module.") else wrapper
            attribute = name.removeprefix("module.")
            stack.enter_context(
                mock.patch.object(target, attribute, replacement)
            )
        _replay.steps = steps
        try:
            yield
        finally:
            _replay.steps = None


def replay(case_id: str, steps: int, breakage: dict | None = None) -> None:
    """Run one oracle case through the wrapper; raise as the case does
    (`unittest.SkipTest` for Keras's own skips)."""
    reason = keras_skip_reason(case_id)
    if reason is not None:
        raise unittest.SkipTest(reason)
    case = make_case(case_id)
    with replaying(steps, breakage):
        case.debug()


# ----------------------------------------------------------------------
# Deliberately broken wrappers (the suite must fail each)
# ----------------------------------------------------------------------
def _sum_instead_of_mean() -> dict:
    original = GradientAccumulationOptimizer._local_mean

    def local_sum(self, slot):
        mean = original(self, slot)
        return _module.divide_gradient(mean, 1 / self.accumulation_steps)

    return {"_local_mean": local_sum}


def _update_every_micro_step() -> dict:
    original = GradientAccumulationOptimizer._local_mean

    def micro_gradient(self, slot):
        # The accumulator holds this micro-step's gradient only.
        mean = original(self, slot)
        return _module.divide_gradient(mean, 1 / self.accumulation_steps)

    return {
        "_window_complete": lambda self: tf.constant(True),
        "_local_mean": micro_gradient,
    }


def _clip_per_micro_step() -> dict:
    original = GradientAccumulationOptimizer._accumulate

    def clip_then_accumulate(self, grads, slots):
        grads = self.inner_optimizer._clip_gradients(grads)
        original(self, grads, slots)

    return {
        "_accumulate": clip_then_accumulate,
        "module._has_clipping": lambda optimizer: False,
    }


BROKEN_WRAPPERS: dict[str, Callable[[], dict]] = {
    "sum_instead_of_mean": _sum_instead_of_mean,
    "update_every_micro_step": _update_every_micro_step,
    "clip_per_micro_step": _clip_per_micro_step,
}


# ----------------------------------------------------------------------
# Command line: every case on the backend in force (docs/development.md)
# ----------------------------------------------------------------------
def known_differences(cases: list[str]) -> dict[str, str]:
    """`KNOWN_DIFFERENCES` on the backend in force: on JAX Keras's sparse
    oracle instruments the variables' own `assign*` for every optimizer,
    and the inner optimizer writes through them (the same limit as
    `_SPARSE_INSTRUMENTATION`, for every `test_sparse_gradients_*` case;
    the `test_sparse_correctness_*` cases pass)."""
    known = dict(KNOWN_DIFFERENCES)
    if keras.backend.backend() == "jax":
        for case in cases:
            if case.startswith(
                "optimizer_sparse_test:OptimizerSparseTest."
                "test_sparse_gradients_"
            ):
                known[case] = _SPARSE_INSTRUMENTATION
    return known


def main(argv: list[str] | None = None) -> int:
    """Replay every case at K micro-steps (default 1), print the counts and
    each failure; exit 1 on a failure not listed as a known difference or a
    known difference that passes."""
    import argparse
    import time

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--only", default="", help="case ids containing it")
    args = parser.parse_args(argv)
    cases = [c for c in oracle_cases(oracle_modules()) if args.only in c]
    known = known_differences(cases)
    passed, skipped, expected, unexpected, fixed = [], [], [], [], []
    start = time.perf_counter()
    for case in cases:
        try:
            replay(case, args.steps)
        except unittest.SkipTest:
            skipped.append(case)
        except KeyboardInterrupt:
            raise
        except BaseException as exc:  # noqa: BLE001 - reported, not raised
            # pytest.fail/skip, which Keras's cases call, raise
            # BaseExceptions.
            if type(exc).__name__ == "Skipped":
                skipped.append(case)
                continue
            line = f"{case}: {type(exc).__name__}: {str(exc)[:200]}"
            (expected if case in known else unexpected).append(line)
        else:
            (fixed if case in known else passed).append(case)
    print(
        f"Keras {keras.version()} optimizer oracles on "
        f"{keras.backend.backend()}, K={args.steps}: {len(cases)} cases, "
        f"{len(passed)} passed, {len(skipped)} skipped by Keras, "
        f"{len(expected)} known differences, {len(unexpected)} unexpected "
        f"failures, {len(fixed)} known differences passing "
        f"({time.perf_counter() - start:.0f} s)"
    )
    for line in unexpected:
        print("UNEXPECTED", line)
    for case in fixed:
        print("NOW PASSES (remove from KNOWN_DIFFERENCES)", case)
    return 1 if unexpected or fixed else 0


if __name__ == "__main__":
    raise SystemExit(main())

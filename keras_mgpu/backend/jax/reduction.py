"""One cross-device gradient reduction per accumulation window on JAX.

Keras 3.15's JAX `train_step` differentiates the loss of the globally
sharded batch, so XLA all-reduces every micro-step's gradient before any
optimizer sees it: `K` reductions per update. The step here
(`per_device_train_step`, installed on a model by `install`) computes each
device's gradient of its own shard of the micro-batch inside a
`jax.shard_map` over the data axis, with no cross-device sum, and hands the
optimizer the gradients with a leading per-device axis (`(R, *shape)`,
sharded over the data axis: each device holds its own row). A
`GradientAccumulationOptimizer(..., reduction="per_update")` adds them to
accumulators of that shape and layout (`per_device_accumulator_layout`),
and at the end of the window takes the mean over devices and micro-steps
once (`keras_mgpu/backend/jax/accumulation.py`): one all-reduce of the
gradients' size per update, none in a micro-step that only accumulates.

What still crosses devices in every micro-step: the loss's and metrics'
sums (scalars; `fit`'s logs need them), and the new values of float
non-trainable variables the step changes (e.g. `BatchNormalization`'s
moving statistics, averaged over devices; each device normalises its
shard with its own statistics). Random layers draw on each device with
the device index folded into their seed (different masks per shard).

The step reads private Keras code (the JAX trainer's `train_step`, whose
body it follows, `compute_loss_and_updates`, `_update_metrics_variables`,
`make_train_function`, and `unpack_x_y_sample_weight`): `check_keras_code`
compares each with the fingerprints of the releases it was read from and
tested with (`KNOWN_FINGERPRINTS`), and `reduction="per_update"` is refused
at construction where one differs.

Nothing here imports a feature package; jax is imported where it is used.
"""

from __future__ import annotations

import functools
from typing import Any

# Set on a model (untracked) once the step is installed on it.
_INSTALLED_ATTR = "_keras_mgpu_per_update_step"
_ATTRIBUTE = "train_step"
# The name Keras 3.15 gives a `SeedGenerator`'s state variable.
_SEED_STATE = "seed_generator_state"

# Fingerprints (keras_mgpu/_code_fingerprint.py: the code without docstring,
# comments or layout) of the Keras code the per-device step relies on, with
# the releases that have it; measured with tools/keras_fingerprints.py on
# the wheels of Keras 3.10.0-3.15.1 and keras-nightly 3.16.0.dev2026102704.
# Only code the step was tested with is listed (3.15.1; 3.13-3.15.0 have
# the same code): 3.10-3.11's `train_step` and `_update_metrics_variables`
# and 3.10-3.12's `make_train_function` differ, and the 3.16 nightly's
# `make_train_function` (its `lax.scan` loop, fingerprint b2766e8f68510af2)
# is not tested yet. The JAX trainer class is `Trainer` from 3.16.
NIGHTLY = "3.16.0.dev2026102704"
TRAINER_CLASS_NAMES = ("JAXTrainer", "Trainer")
KNOWN_FINGERPRINTS: dict[str, dict[str, str]] = {
    # Followed: the step returns what it returns, from the same state.
    "JAXTrainer.train_step": {"488e66565ca4c375": f"3.12-3.15, {NIGHTLY}"},
    # Called per device: (loss, (unscaled loss, y_pred, non-trainables,
    # metrics)), with `optimizer_variables` for the loss scale.
    "JAXTrainer.compute_loss_and_updates": {
        "d49f6b5684b58c55": f"3.10-3.15, {NIGHTLY}"
    },
    # Called per device: the metrics variables' new values.
    "JAXTrainer._update_metrics_variables": {
        "d0f569f0eaec432d": f"3.12-3.15, {NIGHTLY}"
    },
    # Relied on: its step calls `self.train_step`, read on the instance.
    "JAXTrainer.make_train_function": {"849cb1f749547018": "3.13-3.15"},
    "unpack_x_y_sample_weight": {"f19a15bb86fdc1df": f"3.10-3.15, {NIGHTLY}"},
}


def _keras_lookups() -> dict[str, Any]:
    """For each name of `KNOWN_FINGERPRINTS`, a function without arguments
    that returns the live Keras function."""
    import importlib

    def trainer(name: str) -> Any:
        return lambda: vars(trainer_class())[name]

    def unpack() -> Any:
        module = importlib.import_module(
            "keras.src.trainers.data_adapters.data_adapter_utils"
        )
        return module.unpack_x_y_sample_weight

    return {
        **{
            f"JAXTrainer.{name}": trainer(name)
            for name in (
                "train_step",
                "compute_loss_and_updates",
                "_update_metrics_variables",
                "make_train_function",
            )
        },
        "unpack_x_y_sample_weight": unpack,
    }


def trainer_class() -> type:
    """Keras's JAX trainer class, whichever name it has (raises
    AttributeError when there is none)."""
    import importlib

    from keras_mgpu._code_fingerprint import class_named

    module = importlib.import_module("keras.src.backend.jax.trainer")
    return class_named(module, TRAINER_CLASS_NAMES, "trainer class")


def check_keras_code() -> str | None:
    """Why the per-device step cannot run on the installed Keras (a
    sentence naming each function whose code differs from the releases it
    was read from), or None when every one matches."""
    import keras

    from keras_mgpu._code_fingerprint import code_differences

    differences = code_differences(_keras_lookups(), KNOWN_FINGERPRINTS)
    if not differences:
        return None
    return (
        f"the per-device step follows private code of Keras's JAX trainer "
        f"that differs in Keras {keras.version()} from the releases it was "
        "read from and tested with: " + "; ".join(differences)
    )


def data_axis(distribution: Any = None) -> tuple:
    """(jax mesh or None, data axis name or None, devices on that axis) for
    the distribution given or in force; (None, None, 1) without one."""
    from keras_mgpu.backend.jax.distribution import (
        current_distribution,
        data_parallel_size,
    )

    distribution = current_distribution(distribution)
    size = data_parallel_size(distribution)
    if distribution is None:
        return None, None, 1
    name = distribution.batch_dim_name
    return distribution.device_mesh.backend_mesh, name, size


def per_device_accumulator_layout(distribution: Any, rank: int) -> Any:
    """The `keras.distribution.TensorLayout` of a per-device accumulator of
    `rank` dimensions (its leading axis over the data axis, the rest whole),
    or None without a distribution."""
    import keras

    from keras_mgpu.backend.jax.distribution import current_distribution

    distribution = current_distribution(distribution)
    if distribution is None:
        return None
    axes = [distribution.batch_dim_name] + [None] * (rank - 1)
    return keras.distribution.TensorLayout(axes, distribution.device_mesh)


def check_distribution(distribution: Any = None) -> str | None:
    """Why the per-device step cannot run under the distribution given or
    in force (a sentence), or None when it can: no distribution, or
    `DataParallel` (every weight replicated)."""
    from keras_mgpu.backend.jax.distribution import (
        current_distribution,
        distribution_kind,
    )

    distribution = current_distribution(distribution)
    kind = distribution_kind(distribution)
    if kind in ("default", "data_parallel"):
        return None
    return (
        f"the distribution in force is {type(distribution).__name__}, "
        "which may shard weights over a model axis (each device's gradient "
        "would then be a partial one that the step itself must sum); it "
        "needs keras.distribution.DataParallel or no distribution"
    )


def check_replicated(variables: list) -> str | None:
    """A sentence naming the first variable not replicated on every device
    (its layout names a mesh axis), or None."""
    for variable in variables:
        layout = getattr(variable, "_layout", None)
        axes = getattr(layout, "axes", None)
        if axes and any(axis is not None for axis in axes):
            return (
                f"variable {variable.path!r} is sharded (layout axes "
                f"{tuple(axes)}); the per-device step needs every weight "
                "replicated"
            )
    return None


def install(model: Any) -> None:
    """Make `model.fit` run `per_device_train_step` (an instance attribute
    shadows the class's `train_step`, as Keras's trainer reads it when it
    makes its train function). Idempotent.

    Raises ValueError when the model's class overrides `train_step` (the
    step would replace the user's) or its optimizer is not the one that
    accumulates per device (e.g. `mixed_float16`'s `LossScaleOptimizer`
    around it, whose dynamic scale the per-device step cannot read).
    """
    if model.__dict__.get(_INSTALLED_ATTR):
        return
    if type(model).train_step is not trainer_class().train_step:
        raise ValueError(
            f"Model {model.name!r} overrides `train_step` "
            f"({type(model).__name__}.train_step), which "
            "`reduction='per_update'` would have to replace. Use "
            "reduction='auto' (one reduction per micro-step), or, in your "
            "own step, take per-device gradients with "
            "`keras_mgpu.backend.jax.reduction.per_device_train_step` as a "
            "model."
        )
    if not getattr(model.optimizer, "_per_device_accumulation", False):
        raise ValueError(
            "`reduction='per_update'` needs the model's optimizer to be the "
            "GradientAccumulationOptimizer itself. Received: "
            f"model.optimizer={type(model.optimizer).__name__} (under the "
            "'mixed_float16' policy `compile` wraps it in a "
            "LossScaleOptimizer, whose dynamic scale the per-device step "
            "cannot read). Use reduction='auto', or a static "
            "`loss_scale_factor` on the inner optimizer."
        )
    object.__setattr__(
        model, _ATTRIBUTE, functools.partial(per_device_train_step, model)
    )
    object.__setattr__(model, _INSTALLED_ATTR, True)
    # A train function made before (with Keras's step) is made again.
    model.train_function = None


def is_installed(model: Any) -> bool:
    """Whether `install` ran on `model`."""
    return bool(model.__dict__.get(_INSTALLED_ATTR))


def per_device_train_step(model: Any, state: tuple, data: Any) -> tuple:
    """Keras's JAX `train_step` (same state and data, same return) with
    gradients taken per device and handed to the optimizer unreduced.

    Each device runs the forward and backward pass of `model` on its shard
    of the micro-batch (`jax.shard_map` over the data axis; one device
    without a distribution); the gradients come out as `(R, *shape)`
    arrays sharded over that axis, the mean of whose rows is the gradient
    of the global batch's mean loss (shards of equal size). Metrics
    variables take the sum over devices of each device's change; float
    non-trainable variables the step changes take the mean over devices.
    """
    import jax
    import keras
    from keras.src.trainers.data_adapters import data_adapter_utils

    if not getattr(model.optimizer, "_per_device_rows", None):
        # The model was compiled again with another optimizer since: it
        # takes Keras's step.
        return trainer_class().train_step(model, state, data)
    trainable, non_trainable, optimizer_values, metrics_values = state
    x, y, sample_weight = data_adapter_utils.unpack_x_y_sample_weight(data)
    mesh, axis, _ = data_axis()
    seeds = [
        getattr(v, "name", "") == _SEED_STATE
        for v in model.non_trainable_variables
    ]
    floats = [
        keras.backend.is_float_dtype(v.dtype)
        for v in model.non_trainable_variables
    ]

    def local(trainable, non_trainable, metrics_values, batch):
        x, y, sample_weight = batch
        index = 0 if mesh is None else jax.lax.axis_index(axis)
        # Each device draws its own random numbers: its index is added to
        # every seed's first word (and taken off again below).
        non_trainable = [
            _shift_seed(v, index, 1) if is_seed else v
            for v, is_seed in zip(non_trainable, seeds)
        ]
        grad_fn = jax.value_and_grad(
            model.compute_loss_and_updates, has_aux=True
        )
        # `optimizer_variables=()`: Keras scales the loss in a stateless
        # scope mapping these to the optimizer's variables (3.15); our
        # wrapper's `scale_loss` reads only its static factor.
        (_, aux), grads = grad_fn(
            trainable,
            non_trainable,
            metrics_values,
            x,
            y,
            sample_weight,
            training=True,
            optimizer_variables=(),
        )
        unscaled_loss, y_pred, new_non_trainable, new_metrics = aux
        _, new_metrics = model._update_metrics_variables(
            new_metrics, unscaled_loss, x, y, y_pred, sample_weight
        )
        new_metrics = [
            old + _sum(new - old, mesh, axis)
            for old, new in zip(metrics_values, new_metrics)
        ]
        merged = []
        for old, new, is_seed, is_float in zip(
            non_trainable, new_non_trainable, seeds, floats
        ):
            if is_seed:
                new = _shift_seed(new, index, -1)
            elif is_float and new is not old:
                new = _mean(new, mesh, axis)
            merged.append(new)
        return [g[None] for g in grads], merged, new_metrics

    if mesh is None:
        grads, non_trainable, metrics_values = local(
            trainable, non_trainable, metrics_values, (x, y, sample_weight)
        )
    else:
        replicated = jax.sharding.PartitionSpec()
        sharded = jax.sharding.PartitionSpec(axis)
        # `check_vma=False`: the values returned as replicated are made
        # equal on every device above (sums, means, unshifted seeds).
        grads, non_trainable, metrics_values = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(replicated, replicated, replicated, sharded),
            out_specs=(sharded, replicated, replicated),
            check_vma=False,
        )(trainable, non_trainable, metrics_values, (x, y, sample_weight))

    trainable, optimizer_values = model.optimizer.stateless_apply(
        optimizer_values, grads, trainable
    )
    with keras.StatelessScope(
        state_mapping=list(zip(model.metrics_variables, metrics_values))
    ):
        logs = model.get_metrics_result()
    return logs, (trainable, non_trainable, optimizer_values, metrics_values)


def _shift_seed(state: Any, index: Any, sign: int) -> Any:
    """`state` with `sign * index` added to its first word (unsigned
    arithmetic wraps, so the shift is undone exactly)."""
    import jax.numpy as jnp

    shift = jnp.zeros(state.shape, state.dtype)
    shift = shift.at[0].set(jnp.asarray(index).astype(state.dtype))
    return state + shift if sign > 0 else state - shift


def _sum(value: Any, mesh: Any, axis: str | None) -> Any:
    import jax

    return value if mesh is None else jax.lax.psum(value, axis)


def _mean(value: Any, mesh: Any, axis: str | None) -> Any:
    import jax

    return value if mesh is None else jax.lax.pmean(value, axis)

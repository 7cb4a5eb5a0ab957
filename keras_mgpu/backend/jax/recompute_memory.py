"""What the backward pass of a JAX function keeps: its saved residuals.

Recompute trades activations kept for the backward pass against a second
forward. On a GPU the effect shows in the allocator's peak; on the CPU,
XLA's compiled memory analysis does not show it (measured: `jax.checkpoint`
blocks report the temp size of the plain function). What does show it on
every device is the list of residuals `jax.vjp` saves between the forward
and the backward pass: the arrays the linearized function closes over.
`saved_residuals` reads them from the jaxpr of `jax.vjp` (public API; the
same reading as JAX's private `jax._src.ad_checkpoint.saved_residuals`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.extend.core
import numpy as np

from keras_mgpu._flavour import keras


def saved_residuals(function: Callable, *args: Any) -> list[dict]:
    """The arrays `jax.vjp(function, *args)` keeps for the backward pass.

    Args:
        function: a JAX-traceable function of `args` (pytrees of arrays).
        *args: its arguments.

    Returns:
        One dict per distinct residual: `shape`, `dtype`, `bytes`,
        `memory` (`"device"`, or `"host"` for a residual kept in host
        memory: `apply_recompute(..., offload=True)`) and `argument` (True
        when the residual is one of `args` itself, a weight or the input,
        which the caller holds anyway).
    """
    leaves = jax.tree_util.tree_leaves(args)

    def linearized(*flat):
        rebuilt = jax.tree_util.tree_unflatten(
            jax.tree_util.tree_structure(args), flat
        )
        return jax.vjp(lambda *a: function(*a), *rebuilt)

    closed, shapes = jax.make_jaxpr(linearized, return_shape=True)(*leaves)
    count = len(jax.tree_util.tree_leaves(shapes[1]))
    jaxpr = closed.jaxpr
    outvars = jaxpr.outvars[len(jaxpr.outvars) - count :]
    # Arguments and closed-over constants are held by the caller anyway.
    inputs = {id(v) for v in [*jaxpr.invars, *jaxpr.constvars]}
    found, seen = [], set()
    for var in outvars:
        aval = getattr(var, "aval", None)
        if aval is None or not hasattr(aval, "shape"):
            continue
        if isinstance(var, jax.extend.core.Literal):  # Nothing kept.
            continue
        if id(var) in seen:
            continue
        seen.add(id(var))
        size = int(np.prod(aval.shape, dtype=np.int64))
        found.append(
            {
                "shape": tuple(aval.shape),
                "dtype": str(aval.dtype),
                "bytes": size * np.dtype(aval.dtype).itemsize,
                "memory": memory_of(aval),
                "argument": id(var) in inputs,
            }
        )
    return found


def memory_of(aval: Any) -> str:
    """`"host"` for a value JAX places in host memory (`pinned_host` or
    `unpinned_host`, the `<host>` of a jaxpr), else `"device"`."""
    space = getattr(aval, "memory_space", None)
    return "host" if "host" in str(space).lower() else "device"


def residual_bytes(
    function: Callable,
    *args: Any,
    include_arguments: bool = False,
    memory: str | None = None,
) -> int:
    """Bytes of the residuals `function` saves for its backward pass (the
    activations), without the arguments unless `include_arguments`; only
    those kept in `memory` (`"device"` or `"host"`) if given."""
    return sum(
        r["bytes"]
        for r in saved_residuals(function, *args)
        if (include_arguments or not r["argument"])
        and memory in (None, r["memory"])
    )


def _regions(jaxpr: Any) -> list:
    """The outermost checkpointed regions (`jax.checkpoint` equations) of
    `jaxpr`, searching inside calls (`jit`, custom derivatives)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("remat2", "checkpoint"):
            found.append(eqn.params["jaxpr"])
            continue
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found.extend(_regions(getattr(sub, "jaxpr", sub)))
    return found


def checkpoint_count(function: Callable, *args: Any) -> int:
    """How many outermost checkpointed regions (`jax.checkpoint`) the
    program of `function(*args)` runs."""
    return len(_regions(jax.make_jaxpr(function)(*args).jaxpr))


def _bytes_of(aval: Any) -> int:
    """Bytes of a value of `aval`, wherever it lives (0 for float0
    cotangents and tokens: nothing stored)."""
    try:
        itemsize = np.dtype(aval.dtype).itemsize
    except TypeError:
        return 0
    return int(np.prod(aval.shape, dtype=np.int64)) * itemsize


def _bytes(var: Any) -> int:
    """Device bytes of `var` (a value kept in host memory takes none)."""
    aval = getattr(var, "aval", None)
    if aval is None or not hasattr(aval, "shape"):
        return 0
    if memory_of(aval) == "host":
        return 0
    return _bytes_of(aval)


def _is_var(var: Any) -> bool:
    return not isinstance(
        var, (jax.extend.core.Literal, jax.extend.core.DropVar)
    )


def _peak_live(jaxpr: Any, keep_outputs: bool) -> int:
    """The most bytes of values `jaxpr` creates that are alive at once
    when its equations run in order (a value lives from the equation that
    makes it to the last that reads it; inputs are not counted, outputs
    only with `keep_outputs`). An equation with inner programs (a
    checkpointed region, a `jit`) holds, while it runs, the peak of the
    inner program."""
    eqns = jaxpr.eqns
    last_use: dict = {}
    for i, eqn in enumerate(eqns):
        for v in eqn.invars:
            if _is_var(v):
                last_use[v] = i
    end = len(eqns)
    outputs = {v for v in jaxpr.outvars if _is_var(v)}
    for v in outputs:
        last_use[v] = end
    created: set = set()
    live = peak = 0
    for i, eqn in enumerate(eqns):
        made = [v for v in eqn.outvars if _is_var(v)]
        size = sum(_bytes(v) for v in made)
        inner = [
            _peak_live(getattr(sub, "jaxpr", sub), keep_outputs=True)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params)
        ]
        peak = max(peak, live + max([size, *inner]))
        for v in made:
            if last_use.get(v, -1) > i and (keep_outputs or v not in outputs):
                created.add(v)
                live += _bytes(v)
        for v in eqn.invars:
            if _is_var(v) and v in created and last_use[v] == i:
                created.discard(v)
                live -= _bytes(v)
        peak = max(peak, live)
    return peak


def backward_peak_bytes(function: Callable, *args: Any) -> int:
    """The most bytes of intermediate values alive at once in the program
    that computes the gradient of `function` (a scalar) with respect to
    all of `args`, its equations run in order: the activations the forward
    keeps, plus what the backward pass holds at its fullest (a
    checkpointed region's recomputed activations included). The arguments
    and the gradients returned are not counted, nor values kept in host
    memory (offloaded activations). A static reading of the
    program JAX hands to XLA; XLA may reorder and fuse, so it is an
    estimate of a device's peak, which it tracks on a GPU.

    Args:
        function: a JAX-traceable scalar function of `args` (pytrees of
            arrays; integer arrays allowed).
        *args: its arguments.
    """
    grad = jax.grad(function, argnums=tuple(range(len(args))), allow_int=True)
    closed = jax.make_jaxpr(grad)(*args)
    return _peak_live(closed.jaxpr, keep_outputs=False)


def _step_of(model: Any, y: Any, loss: Callable | None) -> Callable:
    def mse(y_true, y_pred):
        return keras.ops.mean(keras.ops.square(y_pred - y_true))

    loss = loss or mse

    def step(trainable, non_trainable, x):
        y_pred, _ = model.stateless_call(
            trainable, non_trainable, x, training=True
        )
        return loss(y, y_pred)

    return step


def model_backward_peak_bytes(
    model: Any, x: Any, y: Any, loss: Callable | None = None
) -> int:
    """`backward_peak_bytes` of a training step of `model` (see
    `model_residual_bytes` for the arguments)."""
    return backward_peak_bytes(_step_of(model, y, loss), *_model_args(model, x))


def _model_args(model: Any, x: Any) -> tuple:
    trainable = [v.value for v in model.trainable_variables]
    non_trainable = [v.value for v in model.non_trainable_variables]
    return (
        trainable,
        non_trainable,
        keras.tree.map_structure(keras.ops.convert_to_tensor, x),
    )


def model_residual_bytes(
    model: Any,
    x: Any,
    y: Any,
    loss: Callable | None = None,
    memory: str | None = None,
) -> int:
    """Bytes of the activations a training step of `model` keeps for its
    backward pass: the residuals of the loss as a function of the model's
    trainable and non-trainable values and of `x` (`stateless_call` with
    `training=True`), arguments excluded.

    Args:
        model: a built Keras model.
        x: a batch of inputs.
        y: its targets.
        loss: `loss(y, y_pred) -> scalar` (default: mean squared error).
        memory: count only the residuals kept in `"device"` or `"host"`
            memory (default: all).
    """

    return residual_bytes(
        _step_of(model, y, loss), *_model_args(model, x), memory=memory
    )


def _offloaded(jaxpr: Any) -> int:
    total = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "device_put":
            total += sum(
                _bytes_of(v.aval)
                for v in eqn.outvars
                if memory_of(v.aval) == "host"
            )
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            total += _offloaded(getattr(sub, "jaxpr", sub))
    return total


def train_step_offloaded_bytes(model: Any, x: Any, y: Any = None) -> int:
    """Bytes the model's own `train_step` (the one `fit` jits, under the
    `keras.distribution` in force) moves to host memory per step: the
    activations `apply_recompute(..., offload=True)` keeps there, read
    from the step's program (each `device_put` to a host memory space),
    global over the mesh. 0 without offload.

    The model must be compiled and its optimizer built; `x` and `y` are
    the global batch (arrays, or anything with `shape` and `dtype`).
    """
    from keras_mgpu.backend.jax.compiled_memory import abstract_step_arguments

    state, data = abstract_step_arguments(model, x, y)
    return _offloaded(jax.make_jaxpr(model.train_step)(state, data).jaxpr)


__all__ = [
    "checkpoint_count",
    "memory_of",
    "backward_peak_bytes",
    "model_backward_peak_bytes",
    "model_residual_bytes",
    "residual_bytes",
    "train_step_offloaded_bytes",
    "saved_residuals",
]

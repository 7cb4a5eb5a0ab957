"""Place the ops of a training step that nobody placed next to their data.

Inside `model.fit`'s step, the loss, the optimizer's update arithmetic,
gradient clipping, accumulation and moving averages are created outside
any device scope, so TensorFlow runs them all on the default device: every
stage's gradients would travel to device 0 for the update and the result
back (Keras 3.15's optimizers assign to the variable on its device, but
compute the new value on the default one). `colocate_unplaced_ops` gives
each such op the device of its largest input whose device is known
(variables count as being on their device), which keeps an update on the
device of its variable and a stage's tensors on the stage.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from keras_mgpu._flavour import tf

# How far to look through ops that only forward a value (a variable read
# is a ReadVariableOp on a captured handle, often behind an Identity).
_PASS_THROUGH = ("Identity", "ReadVariableOp", "Cast", "Reshape")
_MAX_DEPTH = 4


# Per function graph: {id(inner placeholder): outer tensor}.
_CAPTURES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _captured_external(tensor: Any) -> Any:
    """The outer tensor that a function-graph placeholder captures, if any.

    Read from `FuncGraph.captures` (TensorFlow 2.21): pairs of (outer
    tensor, inner placeholder); a captured variable's outer tensor is its
    resource handle, whose `device` is the variable's device. Indexed per
    graph, re-read only on a miss (the device function runs for every op
    of the step).
    """
    graph = tensor.graph
    index = _CAPTURES.get(graph)
    if index is None or id(tensor) not in index:
        captures = getattr(graph, "captures", None) or ()
        index = {id(internal): external for external, internal in captures}
        _CAPTURES[graph] = index
    return index.get(id(tensor))


def tensor_device(tensor: Any, depth: int = 0) -> str:
    """The device a graph tensor is known to live on, or "" if unknown."""
    if depth > _MAX_DEPTH:
        return ""
    if tf.executing_eagerly() or not hasattr(tensor, "op"):
        return getattr(tensor, "device", "") or ""
    op = tensor.op
    if op.device:
        return op.device
    if op.type == "Placeholder":
        external = _captured_external(tensor)
        if external is None:
            return ""
        if not hasattr(external, "op") or not hasattr(external, "graph"):
            return getattr(external, "device", "") or ""  # eager handle
        return tensor_device(external, depth + 1)
    if op.type in _PASS_THROUGH and op.inputs:
        return tensor_device(op.inputs[0], depth + 1)
    return ""


def _size(tensor: Any) -> float:
    shape = getattr(tensor, "shape", None)
    if shape is None or shape.rank is None:
        return float("inf")
    size = 1.0
    for dim in shape:
        size *= float("inf") if dim is None else float(dim)
    return size


def _device_of_largest_input(op: Any) -> str:
    """The device function: an op's own device, else that of its largest
    placed input (ties: the first)."""
    if op.device:
        return op.device
    best, best_size = "", -1.0
    for tensor in op.inputs:
        device = tensor_device(tensor)
        if device:
            size = _size(tensor)
            if size > best_size:
                best, best_size = device, size
    return best


@contextlib.contextmanager
def colocate_unplaced_ops() -> Iterator[None]:
    """While tracing a `tf.function`: ops created without a device go to
    the device of their largest placed input (see the module docstring).

    A TensorFlow device function (public `tf.compat.v1.device`, applied to
    function graphs and, as TensorFlow documents, copied into nested
    `tf.cond` / `tf.while_loop` bodies). Ops that have a device keep it;
    ops whose inputs are all unplaced (the input pipeline, constants) stay
    where TensorFlow puts them. Eagerly it does nothing: TensorFlow does
    not allow device functions there.
    """
    if tf.executing_eagerly():
        yield
        return
    with tf.compat.v1.device(_device_of_largest_input):
        yield


def optimizer_chain(optimizer: Any) -> list:
    """The optimizer and those it wraps (`inner_optimizer`, as Keras's
    `LossScaleOptimizer` and `GradientAccumulationOptimizer` name it)."""
    chain: list = []
    while optimizer is not None and all(optimizer is not o for o in chain):
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return chain


def _keep_gradients(grads_and_vars: Any) -> list:
    return list(grads_and_vars)


@contextlib.contextmanager
def gradients_stay_on_their_devices(optimizer: Any) -> Iterator[None]:
    """Skip the optimizer's one-replica gradient all-reduce while tracing.

    Keras 3.15's TensorFlow optimizers sum each step's gradients over the
    replicas (`TFOptimizer._all_reduce_sum_gradients`, private) through
    `ReplicaContext.all_reduce`, which wraps all the gradients in a single
    `IdentityN` op (to make the all-reduce differentiable). With one
    replica the sum is the identity, but one op over every stage's
    gradients must sit on one device: all gradients would travel there and
    back. Placed models only run with one replica (`check_strategy`), so
    the gradients are passed through as they are.
    """
    patched = [
        o
        for o in optimizer_chain(optimizer)
        if hasattr(o, "_all_reduce_sum_gradients")
        and "_all_reduce_sum_gradients" not in vars(o)
    ]
    for o in patched:
        o._all_reduce_sum_gradients = _keep_gradients
    try:
        yield
    finally:
        for o in patched:
            del o._all_reduce_sum_gradients

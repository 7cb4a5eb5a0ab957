"""The one recomputation engine behind `RecomputeGrad` and in-place recompute.

`recompute(forward, structure, state_layers)` runs `forward` once and keeps
nothing inside it for backprop but its inputs; the backward pass runs the
computation again under a gradient tape and differentiates that (gradient
checkpointing, Chen et al. 2016). Random draws are replayed and stateful
updates happen once (see `recompute`). Private Keras hooks live here, each in
one function naming the version it was read from.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from keras_mgpu._flavour import IS_TF_KERAS, TF_RUNS, keras, tf

# The mask hooks and the variable walk live in the backend layer: the JAX
# engine needs them too.
from keras_mgpu.backend.layer_variables import unique_variables
from keras_mgpu.backend.masking import get_keras_mask, set_keras_mask

# ---------------------------------------------------------------------------
# Private Keras hooks, each isolated in one function.
# ---------------------------------------------------------------------------


def replayed_state_variables(layers: Sequence[Any]) -> list:
    """Variables whose pre-forward value the recomputation must see again.

    Keras 3.15: every `SeedGenerator` owned by a layer contributes its
    integer `state` variable to `layer.variables` (public), and random ops
    draw their stateless seed from it, advancing it on each draw. Any other
    integer, non-trainable variable (a step counter, say) is stateful in the
    same way. Snapshotting these before the forward and feeding the snapshot
    to the recomputation replays exactly the forward's random draws. Keras's
    global seed generator (used by `keras.random.*` calls with `seed=None`)
    is not owned by any layer and is therefore not replayed.
    """
    return unique_variables(
        layers,
        keep=lambda v: not (v.trainable or tf.as_dtype(v.dtype).is_floating),
    )


def tf_keras_state_variables(layers: Sequence[Any]) -> list:
    """tf_keras: the variables the recomputation must not leave changed.

    tf_keras has no `StatelessScope`: running the block again in the
    backward pass runs its assignments again (BatchNormalization moving
    statistics, TFMOT's pruning step and mask updates, any counter). These
    are the block's non-trainable variables; the recomputation starts from
    their values before the forward pass and leaves them as the forward pass
    left them, so each update happens once per step.
    """
    return unique_variables(layers, "non_trainable_variables")


def tf_keras_random_layers(layer: Any) -> list:
    """tf_keras sublayers that draw random numbers (`BaseRandomLayer`).

    tf_keras 2.x random layers (Dropout, GaussianNoise, ...) draw from
    legacy stateful TF ops or a `tf.random.Generator` that cannot be rewound
    from outside; their mask cannot be replayed in the recomputation.
    """
    base = getattr(keras.layers.experimental, "RandomLayer", None)
    if base is None:  # pragma: no cover - tf_keras layout change
        from tf_keras.src.engine.base_layer import BaseRandomLayer as base
    found = []
    for sub in layer._flatten_layers(include_self=True, recursive=True):
        if isinstance(sub, base):
            found.append(sub)
    return found


def check_replayable(layer: Any, subject: str, received: str) -> None:
    """tf_keras: refuse a block whose random draws cannot be replayed."""
    if not IS_TF_KERAS:
        return
    names = [sub.name for sub in tf_keras_random_layers(layer)]
    if names:
        raise ValueError(
            f"{subject} contains layers that draw random numbers "
            f"({', '.join(names)}); under tf_keras their draws cannot be "
            "replayed in the recomputation, which would give wrong "
            "gradients. Recompute only the deterministic parts, or use Keras "
            f"3. Received: {received}"
        )


def current_training() -> Any:
    """The `training` value of the layer call in progress (None if unset).

    A layer whose `call` takes no `training` argument still passes it on to
    its sublayers through Keras's call context: Keras 3.15 keeps it on the
    thread-local `CallContext` in `global_state` ("current_call_ctx"),
    tf_keras 2.x on `base_layer_utils.call_context()`. Neither is public.
    """
    if IS_TF_KERAS:
        from tf_keras.src.engine import base_layer_utils

        return base_layer_utils.call_context().training
    from keras.src.backend.common import global_state

    context = global_state.get_global_attribute("current_call_ctx")
    return None if context is None else context.get_value("training")


def in_symbolic_build() -> bool:
    """Keras 3.15 runs `call` on placeholders in a scratch graph to infer
    output shapes (`backend.compute_output_spec` under a `SymbolicScope`,
    exported as `keras.SymbolicScope`, whose query is not); nothing is
    differentiated there. tf_keras 2.x builds functional models the same way
    but cannot be told apart; recomputing there is harmless."""
    if IS_TF_KERAS:
        return False
    from keras.src.backend.common.symbolic_scope import in_symbolic_scope

    return in_symbolic_scope()


def tapes_paused() -> Any:
    """A context in which no gradient tape of this thread records.

    `tf.custom_gradient` runs its function eagerly with the caller's tapes
    recording (TensorFlow 2.21 `custom_gradient._eager_mode_decorator`):
    every op of the forward pass lands on the outer `GradientTape`, which
    keeps the activations alive until it is deleted, so nothing would be
    saved in an eager step. `tf.recompute_grad` pauses the tapes around its
    forward with TensorFlow's private `record.stop_recording` (read in
    `tensorflow/python/ops/custom_gradient.py`, 2.21); the same context is
    used here. Variable reads are still seen by `custom_gradient`'s
    `VariableWatcher`, which is not a tape.
    """
    from tensorflow.python.eager import record

    return record.stop_recording()


# ---------------------------------------------------------------------------


def recompute(
    forward: Callable[[Any], Any],
    structure: Any,
    state_layers: Sequence[Any],
    again: Callable[[Any], Any] | None = None,
    offload: bool = False,
) -> Any:
    """`forward(structure)`, with its activations recomputed in backprop.

    Floating-point tensors in `structure` (a nest of call arguments) are
    differentiated; everything else (masks, integer ids, Python values) is
    passed as it is. `forward` and `again` take a nest like `structure`.

    Random draws are replayed: the recomputation sees the seed states of
    `state_layers` as they were before the forward. Stateful updates happen
    once: Keras 3 recomputes in a `StatelessScope` that discards them;
    tf_keras restores the layers' non-trainable variables around the
    recomputation.

    Args:
        forward: the computation as the forward pass runs it.
        structure: the arguments.
        state_layers: the layers that `forward` runs (their state is
            replayed / restored).
        again: the computation as the backward pass runs it (default:
            `forward`), e.g. through `Layer.__call__` rather than `call`.
        offload: Keras 3 on JAX only: keep the inputs in pinned host
            memory until the backward pass (`apply_recompute` refuses it
            elsewhere at construction).
    """
    if not TF_RUNS:
        # Keras 3 on JAX: `jax.checkpoint` (keras_mgpu/backend/jax/), which
        # replays the traced forward: `again` has no use there.
        from keras_mgpu.backend.jax.recompute import recompute as on_jax

        return on_jax(forward, structure, state_layers, offload=offload)
    if offload:  # pragma: no cover - refused by apply_recompute
        raise ValueError("offload=True needs Keras 3 on JAX.")
    again = again or forward
    flat = tf.nest.flatten(structure)
    diff_positions = [
        i
        for i, x in enumerate(flat)
        if tf.is_tensor(x) and tf.as_dtype(x.dtype).is_floating
    ]

    masks = [get_keras_mask(flat[i]) for i in diff_positions]

    def substitute(diff_args):
        values = list(flat)
        for position, arg, mask in zip(
            diff_positions, diff_args, masks, strict=True
        ):
            # Keras reads masks off the tensors; the stand-ins the forward
            # and the recomputation get must carry them too.
            if mask is not None and get_keras_mask(arg) is None:
                set_keras_mask(arg, mask)
            values[position] = arg
        return tf.nest.pack_sequence_as(structure, values)

    # Snapshot before the forward: the recomputation must draw the same
    # random numbers as the forward did (see replayed_state_variables).
    # Under tf.function the reads are ordered before the forward's
    # assignments by automatic control dependencies (program order).
    if IS_TF_KERAS:
        replayed = tf_keras_state_variables(state_layers)
        snapshot = [tf.identity(v) for v in replayed]
    else:
        replayed = replayed_state_variables(state_layers)
        snapshot = [tf.identity(v.value) for v in replayed]
    mapping = list(zip(replayed, snapshot, strict=True))
    out_info: dict = {}

    @tf.custom_gradient
    def run(*diff_args):
        # Nothing inside the forward is recorded: the backward pass
        # differentiates the recomputation (see `tapes_paused`).
        with tapes_paused():
            outputs = forward(substitute(diff_args))
        flat_outputs = tf.nest.flatten(outputs)
        # Only tensors cross the custom-gradient boundary; None and Python
        # values in the output structure are passed around it.
        tensor_positions = [
            i for i, x in enumerate(flat_outputs) if tf.is_tensor(x)
        ]
        out_info["structure"] = outputs
        out_info["flat"] = flat_outputs
        out_info["positions"] = tensor_positions
        out_info["masks"] = [get_keras_mask(t) for t in flat_outputs]

        def grad_fn(*output_grads, variables=None):
            return _recompute_gradients(
                lambda args: _tensors_of(again(substitute(args))),
                diff_args,
                output_grads,
                variables or [],
                mapping,
            )

        return tuple(flat_outputs[i] for i in tensor_positions), grad_fn

    results = tf.nest.flatten(run(*[flat[i] for i in diff_positions]))
    flat_results = list(out_info["flat"])
    for position, tensor in zip(out_info["positions"], results, strict=True):
        flat_results[position] = tensor
    for tensor, out_mask in zip(flat_results, out_info["masks"], strict=True):
        if out_mask is not None:
            set_keras_mask(tensor, out_mask)
    return tf.nest.pack_sequence_as(out_info["structure"], flat_results)


def _tensors_of(outputs: Any) -> list:
    return [x for x in tf.nest.flatten(outputs) if tf.is_tensor(x)]


def _recompute_gradients(run, diff_args, output_grads, variables, mapping):
    """Run the computation again and differentiate the recomputation."""
    # Only float, trainable variables get a gradient; the watched set also
    # holds BatchNormalization statistics and seed states.
    watched = [
        v
        for v in variables
        if getattr(v, "trainable", True) and tf.as_dtype(v.dtype).is_floating
    ]
    restore = []
    if IS_TF_KERAS and mapping:
        # Start from the pre-forward state; put the post-forward state back
        # afterwards (see tf_keras_state_variables). Under tf.function,
        # automatic control dependencies order these assignments around the
        # recomputation's reads and writes.
        restore = [(v, tf.identity(v)) for v, _ in mapping]
        for variable, before in mapping:
            variable.assign(before)
    with tf.GradientTape() as tape:
        args = [tf.identity(a) for a in diff_args]
        anchors = [g for g in output_grads if g is not None]
        if not tf.executing_eagerly() and anchors:
            # A data dependency on the incoming gradient keeps graph
            # optimisers from hoisting the recomputation into the forward
            # pass (which would store the activations after all). Same trick
            # as tf.recompute_grad.
            first = tf.reshape(anchors[0], [-1])[:1]
            first = tf.cast(tf.reduce_max(first), tf.bool)
            zero = tf.where(first == first, 0.0, float("nan"))
            args = [a + tf.cast(zero, a.dtype) for a in args]
        tape.watch(args)
        tape.watch(watched)
        with _recompute_scope(mapping):
            flat_outputs = run(args)
    # Integer outputs (ids, cache indices) carry no gradient.
    pairs = [
        (out, tf.zeros_like(out) if grad is None else grad)
        for out, grad in zip(flat_outputs, output_grads, strict=True)
        if tf.as_dtype(out.dtype).is_floating
    ]
    grads = tape.gradient(
        [out for out, _ in pairs],
        args + watched,
        output_gradients=[grad for _, grad in pairs],
        unconnected_gradients=tf.UnconnectedGradients.ZERO,
    )
    if restore:
        with tf.control_dependencies(flat_outputs):
            for variable, after in restore:
                variable.assign(after)
    arg_grads = grads[: len(args)]
    if not tf.executing_eagerly():
        # The gradients flowing to the layers below only once this block's
        # weight gradients exist: those are the last readers of the
        # recomputed activations, so the recomputation of the block below
        # (anchored on these gradients) cannot start while they are alive.
        # Without it the executor may run the chain of input gradients
        # ahead and keep every block's recomputation alive at once (seen
        # under load and with one inter-op thread: a peak above plain's).
        done = [
            g
            for g in tf.nest.flatten(grads[len(args) :], expand_composites=True)
            if g is not None
        ]
        if done:
            with tf.control_dependencies(done):
                arg_grads = [
                    None
                    if g is None
                    else tf.nest.map_structure(
                        tf.identity, g, expand_composites=True
                    )
                    for g in arg_grads
                ]
    by_ref = {
        v.ref(): g for v, g in zip(watched, grads[len(args) :], strict=True)
    }
    var_grads = [by_ref.get(v.ref()) for v in variables]
    return arg_grads, var_grads


def _recompute_scope(mapping):
    if IS_TF_KERAS:
        # tf_keras has no StatelessScope: state is restored around the
        # recomputation instead; stochastic layers are rejected up front.
        return contextlib.nullcontext()
    return keras.StatelessScope(
        state_mapping=mapping, initialize_variables=False
    )

"""`RecomputeGrad`: a layer wrapper that recomputes activations in backprop.

Gradient checkpointing (Chen et al., 2016, "Training Deep Nets with
Sublinear Memory Cost"): the forward pass keeps only the wrapper's inputs; the
backward pass runs the wrapped layer again under a gradient tape and
differentiates that recomputation. Activation memory inside the wrapped layer
is traded for one extra forward pass.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

from keras_mgpu._flavour import (
    IS_TF_KERAS,
    check_flavour,
    keras,
    register_serializable,
    tf,
)

# ---------------------------------------------------------------------------
# Private Keras hooks, each isolated in one function.
# ---------------------------------------------------------------------------


def _get_keras_mask(tensor: Any) -> Any:
    """The Keras mask attached to `tensor`, or None.

    Keras 3.15 keeps masks in `keras.src.backend.common.masking` (an
    attribute, or a side table for tensors that refuse attributes); tf_keras
    2.x uses the `_keras_mask` attribute. Neither is public.
    """
    if IS_TF_KERAS:
        return getattr(tensor, "_keras_mask", None)
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(tensor)


def _set_keras_mask(tensor: Any, mask: Any) -> None:
    """Attach `mask` to `tensor` the way Keras does (see `_get_keras_mask`)."""
    if IS_TF_KERAS:
        try:
            tensor._keras_mask = mask
        except AttributeError:
            pass
        return
    from keras.src.backend.common.masking import set_keras_mask

    set_keras_mask(tensor, mask)


def _replayed_state_variables(layer: Any) -> list:
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
    return [
        v
        for v in layer.variables
        if not v.trainable and not tf.as_dtype(v.dtype).is_floating
    ]


def _tf_keras_state_variables(layer: Any) -> list:
    """tf_keras: the variables the recomputation must not leave changed.

    tf_keras has no `StatelessScope`: running the block again in the
    backward pass runs its assignments again (BatchNormalization moving
    statistics, TFMOT's pruning step and mask updates, any counter). These
    are the block's non-trainable variables; the recomputation starts from
    their values before the forward pass and leaves them as the forward pass
    left them, so each update happens once per step.
    """
    return list(layer.non_trainable_variables)


def _tf_keras_random_layers(layer: Any) -> list:
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


# ---------------------------------------------------------------------------


def _accepts(layer: Any, argument: str) -> bool:
    """Whether `layer.call` names `argument` (Keras's own test for passing
    `training` and `mask`)."""
    try:
        return argument in inspect.signature(layer.call).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return False


@register_serializable
class RecomputeGrad(keras.layers.Wrapper):
    """Wraps a layer so its activations are recomputed in the backward pass.

    The forward output equals the wrapped layer's. During the forward pass
    nothing inside the wrapped layer is kept for backprop except the
    wrapper's inputs; the backward pass calls the wrapped layer again under a
    gradient tape and differentiates that recomputation (gradient
    checkpointing, Chen et al. 2016). Wrap blocks whose internal activations
    are large compared with their inputs (a transformer block, a stack of
    layers); `keras_mgpu.apply_recompute` wraps the blocks of a whole model.

    Behaviour:
    - Randomness is replayed: the recomputation sees the same
      `SeedGenerator` states as the forward pass did, so a block with
      `Dropout` (or any layer drawing from its own Keras `SeedGenerator`) gets
      exactly the gradients of the unwrapped block.
    - Stateful updates happen once: `BatchNormalization` moving statistics
      (and every other variable assignment) are applied by the forward pass
      only. Keras 3: the recomputation runs in a `keras.StatelessScope` that
      discards them. tf_keras: the recomputation starts from the block's
      non-trainable variables as they were before the forward pass and puts
      them back as the forward pass left them (so TFMOT pruning steps and
      masks advance once per step); this holds a transient copy of those
      variables per wrapped block during the backward pass.
    - `training`, masks and extra call arguments are passed through.
      Floating-point tensor arguments are differentiated; others (masks,
      integer ids) are passed as they are.
    - Built on `tf.custom_gradient` with positional arguments only, so it
      runs eagerly, inside `model.fit`'s `tf.function`, with
      `jit_compile=True`, under `mixed_float16` and in the replica context of
      `tf.distribute` strategies (each replica recomputes its own slice;
      nothing is communicated). Unlike `keras.RematScope`, which fails in
      graph mode on TensorFlow.

    Limits: losses added inside the wrapped layer while it runs (activity
    regularizers, `add_loss` in `call`) are computed from the forward pass
    without a gradient path; weight regularizers are unaffected. Under
    tf_keras, wrapping a layer that draws random numbers raises (its mask
    cannot be replayed there).

    Args:
        layer: `keras.layers.Layer`. The layer to wrap: a single layer, a
            `Sequential` block or a functional sub-model. Must not already be
            a `RecomputeGrad`.
        **kwargs: base `Layer` arguments (`name`, ...). `dtype` defaults to
            the wrapped layer's dtype policy.

    Example:

    ```python
    block = keras.Sequential([
        keras.layers.Dense(256, activation="relu"),
        keras.layers.Dropout(0.1),
        keras.layers.Dense(64),
    ])
    inputs = keras.Input((64,))
    outputs = keras_mgpu.RecomputeGrad(block)(inputs)
    model = keras.Model(inputs, outputs)
    model.compile("adam", "mse")
    ```
    """

    def __init__(self, layer: Any, **kwargs: Any) -> None:
        check_flavour(layer, "layer")
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                "Argument `layer` must be a Keras layer (a layer, a "
                "Sequential block or a functional sub-model). Received: "
                f"layer={layer!r} (of type {type(layer).__name__})"
            )
        if isinstance(layer, RecomputeGrad):
            raise ValueError(
                "Argument `layer` is already wrapped in RecomputeGrad; "
                "wrapping it twice only recomputes twice. Received: "
                f"layer={layer.name!r} (RecomputeGrad of "
                f"{type(layer.layer).__name__} {layer.layer.name!r})"
            )
        if IS_TF_KERAS and _tf_keras_random_layers(layer):
            names = [s.name for s in _tf_keras_random_layers(layer)]
            raise ValueError(
                "Argument `layer` contains layers that draw random numbers "
                f"({', '.join(names)}); under tf_keras their draws cannot be "
                "replayed in the recomputation, which would give wrong "
                "gradients. Wrap only the deterministic parts, or use Keras "
                f"3. Received: layer={layer.name!r}"
            )
        if "dtype" not in kwargs:
            policy = getattr(layer, "dtype_policy", None)
            kwargs["dtype"] = policy if policy is not None else layer.dtype
        super().__init__(layer, **kwargs)
        self.supports_masking = bool(getattr(layer, "supports_masking", False))
        if IS_TF_KERAS:
            # `call` attaches the masks the forward pass computed. Without
            # this flag tf_keras asks `compute_mask` again, which for a
            # Sequential or functional block runs the whole block once more.
            self._compute_output_and_mask_jointly = True
        self._layer_accepts_mask = _accepts(layer, "mask")
        self._layer_accepts_training = _accepts(layer, "training")

    def build(self, input_shape: Any = None) -> None:
        if not self.layer.built:
            self.layer.build(input_shape)
            self.layer.built = True
        self.built = True

    def compute_output_shape(self, input_shape: Any) -> Any:
        return self.layer.compute_output_shape(input_shape)

    if not IS_TF_KERAS:

        def compute_output_spec(
            self, inputs: Any, training=None, mask=None, **kwargs
        ) -> Any:
            # Keras 3 builds functional models symbolically; ask the wrapped
            # layer, which knows how (its own `compute_output_shape` or a
            # symbolic run of its `call`), even when it has no
            # `compute_output_shape` of its own.
            if training is not None and self._layer_accepts_training:
                kwargs["training"] = training
            if mask is not None and self._layer_accepts_mask:
                kwargs["mask"] = mask
            return self.layer.compute_output_spec(inputs, **kwargs)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return self.layer.compute_mask(inputs, mask)

    def call(
        self, inputs: Any, training: bool | None = None, mask=None, **kwargs
    ) -> Any:
        structure = (inputs, kwargs)
        flat = tf.nest.flatten(structure)
        diff_positions = [
            i
            for i, x in enumerate(flat)
            if tf.is_tensor(x) and tf.as_dtype(x.dtype).is_floating
        ]

        def run_layer(diff_args):
            values = list(flat)
            for position, arg in zip(diff_positions, diff_args, strict=True):
                values[position] = arg
            layer_inputs, layer_kwargs = tf.nest.pack_sequence_as(
                structure, values
            )
            if training is not None:
                layer_kwargs["training"] = training
            if mask is not None:
                if self._layer_accepts_mask:
                    layer_kwargs["mask"] = mask
                else:
                    # Keras reads the mask off the first input tensor then.
                    first = tf.nest.flatten(layer_inputs)[0]
                    _set_keras_mask(first, tf.nest.flatten(mask)[0])
            return self.layer(layer_inputs, **layer_kwargs)

        # Snapshot before the forward: the recomputation must draw the same
        # random numbers as the forward did (see _replayed_state_variables).
        # Under tf.function the reads are ordered before the forward's
        # assignments by automatic control dependencies (program order).
        if IS_TF_KERAS:
            replayed = _tf_keras_state_variables(self.layer)
            snapshot = [tf.identity(v) for v in replayed]
        else:
            replayed = _replayed_state_variables(self.layer)
            snapshot = [tf.identity(v.value) for v in replayed]
        out_info = {}

        @tf.custom_gradient
        def forward(*diff_args):
            outputs = run_layer(diff_args)
            flat_outputs = tf.nest.flatten(outputs)
            out_info["structure"] = outputs
            out_info["masks"] = [_get_keras_mask(t) for t in flat_outputs]

            def grad_fn(*output_grads, variables=None):
                return self._recompute_gradients(
                    run_layer,
                    diff_args,
                    output_grads,
                    variables or [],
                    list(zip(replayed, snapshot, strict=True)),
                )

            return tuple(flat_outputs), grad_fn

        flat_results = forward(*[flat[i] for i in diff_positions])
        flat_results = tf.nest.flatten(flat_results)
        masks = out_info["masks"]
        for tensor, out_mask in zip(flat_results, masks, strict=True):
            if out_mask is not None:
                _set_keras_mask(tensor, out_mask)
        return tf.nest.pack_sequence_as(out_info["structure"], flat_results)

    def _recompute_gradients(
        self, run_layer, diff_args, output_grads, variables, state_mapping
    ):
        """Run the wrapped layer again and differentiate the recomputation."""
        # Only float, trainable variables get a gradient; the watched set
        # also holds BatchNormalization statistics and seed states.
        watched = [
            v
            for v in variables
            if getattr(v, "trainable", True)
            and tf.as_dtype(v.dtype).is_floating
        ]
        restore = []
        if IS_TF_KERAS and state_mapping:
            # Start from the pre-forward state; put the post-forward state
            # back afterwards (see _tf_keras_state_variables). Under
            # tf.function, automatic control dependencies order these
            # assignments around the recomputation's reads and writes.
            restore = [(v, tf.identity(v)) for v, _ in state_mapping]
            for variable, before in state_mapping:
                variable.assign(before)
        with tf.GradientTape() as tape:
            args = [tf.identity(a) for a in diff_args]
            if not tf.executing_eagerly() and output_grads:
                # A data dependency on the incoming gradient keeps graph
                # optimisers from hoisting the recomputation into the forward
                # pass (which would store the activations after all). Same
                # trick as tf.recompute_grad.
                first = tf.reshape(output_grads[0], [-1])[:1]
                first = tf.cast(tf.reduce_max(first), tf.bool)
                zero = tf.where(first == first, 0.0, float("nan"))
                args = [a + tf.cast(zero, a.dtype) for a in args]
            tape.watch(args)
            tape.watch(watched)
            with self._recompute_scope(state_mapping):
                outputs = run_layer(args)
        flat_outputs = tf.nest.flatten(outputs)
        grads = tape.gradient(
            flat_outputs,
            args + watched,
            output_gradients=list(output_grads),
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
        if restore:
            with tf.control_dependencies(tf.nest.flatten(outputs)):
                for variable, after in restore:
                    variable.assign(after)
        arg_grads = grads[: len(args)]
        var_part = grads[len(args) :]
        by_ref = {v.ref(): g for v, g in zip(watched, var_part, strict=True)}
        var_grads = [by_ref.get(v.ref()) for v in variables]
        return arg_grads, var_grads

    @staticmethod
    def _recompute_scope(state_mapping):
        if IS_TF_KERAS:
            # tf_keras has no StatelessScope: state is restored around the
            # recomputation instead; stochastic layers are rejected at
            # construction.
            return contextlib.nullcontext()
        return keras.StatelessScope(
            state_mapping=state_mapping, initialize_variables=False
        )

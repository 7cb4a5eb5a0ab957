"""`RecomputeGrad`: a layer wrapper that recomputes activations in backprop.

Gradient checkpointing (Chen et al., 2016, "Training Deep Nets with
Sublinear Memory Cost"): the forward pass keeps only the wrapper's inputs; the
backward pass runs the wrapped layer again under a gradient tape and
differentiates that recomputation. Activation memory inside the wrapped layer
is traded for one extra forward pass.
"""

from __future__ import annotations

from typing import Any

from keras_mgpu._flavour import (
    IS_TF_KERAS,
    check_flavour,
    keras,
    register_serializable,
    tf,
)
from keras_mgpu._layer_calls import accepts
from keras_mgpu.backend import require_backend
from keras_mgpu.backend.masking import set_keras_mask
from keras_mgpu.layers._recompute_engine import check_replayable, recompute
from keras_mgpu.layers.recompute_in_place import is_recomputed_in_place


def _first(nest: Any) -> Any:
    """The first leaf of `nest` (tf_keras has no `keras.tree`)."""
    flatten = tf.nest.flatten if IS_TF_KERAS else keras.tree.flatten
    return flatten(nest)[0]


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
    - On Keras 3's JAX backend, built on `jax.checkpoint`: the wrapped layer
      runs as a pure function of its inputs and its variables' values (seed
      states included), so the recomputation replays the same dropout
      masks; state updates and losses added inside are applied once,
      outside the checkpoint (activity regularizers keep their gradient
      path there). Works in `fit`, in a custom loop (`jax.grad` of
      `model.stateless_call`) and under `keras.distribution`. Other backends
      are refused at construction.

    Limits: on TensorFlow, losses added inside the wrapped layer while it
    runs (activity regularizers, `add_loss` in `call`) are computed from the
    forward pass without a gradient path; weight regularizers are
    unaffected. Under
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
        require_backend("RecomputeGrad")
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
        if is_recomputed_in_place(layer):
            raise ValueError(
                "Argument `layer` is already recomputed in place (by "
                "`apply_recompute(..., in_place=True)`); wrapping it too only "
                "recomputes twice. Call `strip_recompute` on its model first. "
                f"Received: layer={layer.name!r}"
            )
        check_replayable(layer, "Argument `layer`", f"layer={layer.name!r}")
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
        self._layer_accepts_mask = accepts(layer, "mask")
        self._layer_accepts_training = accepts(layer, "training")

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
        def run_layer(structure):
            layer_inputs, layer_kwargs = structure
            layer_kwargs = dict(layer_kwargs)
            if training is not None:
                layer_kwargs["training"] = training
            if mask is not None:
                if self._layer_accepts_mask:
                    layer_kwargs["mask"] = mask
                else:
                    # Keras reads the mask off the first input tensor then.
                    set_keras_mask(_first(layer_inputs), _first(mask))
            return self.layer(layer_inputs, **layer_kwargs)

        return recompute(run_layer, (inputs, kwargs), [self.layer])

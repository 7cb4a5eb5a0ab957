"""`PlacedLayer`: one layer whose variables and computation live on one
device, its backward pass included."""

from __future__ import annotations

import inspect
from typing import Any

from keras_mgpu._flavour import check_flavour, keras, register_serializable, tf
from keras_mgpu.placement.devices import (
    canonical_device,
    check_strategy,
    device_exists,
    variables_on,
)


def _get_keras_mask(tensor: Any) -> Any:
    """The Keras mask attached to `tensor`, or None.

    Keras 3.15 keeps masks in `keras.src.backend.common.masking` (not
    public); `tf.custom_gradient` returns new tensors, so the masks the
    wrapped layer attached are carried over by hand.
    """
    from keras.src.backend.common.masking import get_keras_mask

    return get_keras_mask(tensor)


def _set_keras_mask(tensor: Any, mask: Any) -> None:
    from keras.src.backend.common.masking import set_keras_mask

    set_keras_mask(tensor, mask)


def _accepts(layer: Any, argument: str) -> bool:
    """Whether `layer.call` names `argument` (Keras's own test for passing
    `training` and `mask`)."""
    try:
        return argument in inspect.signature(layer.call).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return False


def _differentiable(variable: Any) -> bool:
    return bool(getattr(variable, "trainable", True)) and tf.as_dtype(
        variable.dtype
    ).is_floating


@register_serializable
class PlacedLayer(keras.layers.Wrapper):
    """Runs a layer on one device: its variables, its forward pass and its
    backward pass.

    `apply_placement` wraps every layer of a model in one of these; use it
    directly only to build a placed model by hand.

    - The wrapped layer's variables (weights, BatchNormalization
      statistics, seed states) are created on `device`, also under
      `OneDeviceStrategy`, whose variable creator would otherwise put them
      on its own device. Check with `variable.value.device`.
    - The forward pass runs under `tf.device(device)`, so a tensor crosses
      devices only where a layer on another device consumes it.
    - The backward pass runs on `device` too. TensorFlow does not place
      gradient ops next to their forward ops: a `tape.gradient` called
      outside any device scope (as `model.fit` does) puts every gradient op
      on the default device, which would compute the whole backward pass of
      a placed model on one device. So the layer runs inside a
      `tf.custom_gradient` whose gradient function differentiates a tape
      recorded during the forward pass, under `tf.device(device)`. Nothing
      is recomputed: the gradients are those of the plain layer, exactly.
    - Under a strategy that replicates the model (`MirroredStrategy`,
      multi-worker, ...) building or calling it raises a `ValueError`: a
      replica is one device, so model and data parallelism cannot be
      combined in `tf.distribute`.
    - `supports_jit` is False: XLA compiles a step for one device.
    - Saved with its device. Loaded in a process without that device, it
      warns and lets TensorFlow place the layer (soft placement).

    Args:
        layer: `keras.layers.Layer`. The layer to place (a layer, a
            `Sequential` block, a functional sub-model, a `RecomputeGrad`).
        device: str or `tf.config.LogicalDevice`, e.g. `"/gpu:1"`.
        **kwargs: base `Layer` arguments. `name` defaults to the wrapped
            layer's name (so a model's output names do not change) and
            `dtype` to its dtype policy.

    Example:

    ```python
    inputs = keras.Input((16,))
    x = keras_mgpu.placement.PlacedLayer(keras.layers.Dense(64), "/cpu:0")(inputs)
    outputs = keras_mgpu.placement.PlacedLayer(keras.layers.Dense(1), "/cpu:1")(x)
    model = keras_mgpu.placement.PlacedModel(inputs, outputs)
    ```
    """

    def __init__(self, layer: Any, device: Any, **kwargs: Any) -> None:
        check_flavour(layer, "layer")
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                "Argument `layer` must be a Keras layer. Received: "
                f"layer={layer!r} (of type {type(layer).__name__})"
            )
        if isinstance(layer, PlacedLayer):
            raise ValueError(
                "Argument `layer` is already a PlacedLayer (on "
                f"{layer.device}); a layer runs on one device. Received: "
                f"layer={layer.name!r}"
            )
        kwargs.setdefault("name", layer.name)
        if "dtype" not in kwargs:
            policy = getattr(layer, "dtype_policy", None)
            kwargs["dtype"] = policy if policy is not None else layer.dtype
        super().__init__(layer, **kwargs)
        self.device = canonical_device(device, "device")
        self.supports_masking = bool(getattr(layer, "supports_masking", False))
        self.supports_jit = False
        self._layer_accepts_mask = _accepts(layer, "mask")
        self._layer_accepts_training = _accepts(layer, "training")
        self._warned_missing = False

    def _scope(self):
        """Device scope for this layer: its device when it exists here."""
        if device_exists(self.device):
            return variables_on(self.device)
        if not self._warned_missing:
            self._warned_missing = True
            import warnings

            warnings.warn(
                f"PlacedLayer {self.name!r} was placed on {self.device}, "
                "which this process does not have; TensorFlow places it "
                "instead. Re-place the model for this machine: "
                "keras_mgpu.apply_placement(keras_mgpu.strip_placement("
                "model), devices=...).",
                stacklevel=3,
            )
        import contextlib

        return contextlib.nullcontext()

    def build(self, input_shape: Any = None) -> None:
        check_strategy(f"building PlacedLayer {self.name!r}")
        with self._scope():
            if not self.layer.built:
                self.layer.build(input_shape)
                self.layer.built = True
        self.built = True

    def compute_output_shape(self, input_shape: Any) -> Any:
        return self.layer.compute_output_shape(input_shape)

    def compute_output_spec(
        self, inputs: Any, training=None, mask=None, **kwargs
    ) -> Any:
        # Keras builds functional models symbolically; ask the wrapped layer.
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
        check_strategy(f"calling PlacedLayer {self.name!r}")
        layer_kwargs = dict(kwargs)
        if training is not None and self._layer_accepts_training:
            layer_kwargs["training"] = training
        if mask is not None and self._layer_accepts_mask:
            layer_kwargs["mask"] = mask
        with self._scope():
            return self._call_with_placed_gradient(inputs, layer_kwargs)

    def _call_with_placed_gradient(self, inputs: Any, layer_kwargs: dict):
        structure = (inputs, layer_kwargs)
        flat = tf.nest.flatten(structure)
        diff_positions = [
            i
            for i, x in enumerate(flat)
            if tf.is_tensor(x) and tf.as_dtype(x.dtype).is_floating
        ]
        layer, device = self.layer, self.device
        out_info: dict = {}

        def run_layer(diff_args):
            values = list(flat)
            for position, arg in zip(diff_positions, diff_args, strict=True):
                values[position] = arg
            args, kwargs = tf.nest.pack_sequence_as(structure, values)
            return layer(args, **kwargs)

        @tf.custom_gradient
        def forward(*diff_args):
            # Persistent: a caller may ask for these gradients twice.
            with tf.GradientTape(persistent=True) as tape:
                tape.watch(diff_args)
                outputs = run_layer(diff_args)
            flat_outputs = tf.nest.flatten(outputs)
            out_info["structure"] = outputs
            out_info["masks"] = [_get_keras_mask(t) for t in flat_outputs]

            def grad_fn(*output_grads, variables=None):
                variables = list(variables or [])
                with tf.device(device):
                    return _placed_gradients(
                        tape, flat_outputs, output_grads, diff_args, variables
                    )

            return tuple(flat_outputs), grad_fn

        flat_results = tf.nest.flatten(
            forward(*[flat[i] for i in diff_positions])
        )
        for tensor, out_mask in zip(
            flat_results, out_info["masks"], strict=True
        ):
            if out_mask is not None:
                _set_keras_mask(tensor, out_mask)
        return tf.nest.pack_sequence_as(out_info["structure"], flat_results)

    def get_config(self) -> dict:
        config = super().get_config()
        config["device"] = self.device
        return config

    @classmethod
    def from_config(cls, config: dict, custom_objects=None) -> PlacedLayer:
        config = dict(config)
        device = canonical_device(config.pop("device"), "device")
        # The wrapped layer is constructed on its device: some layers make
        # variables in __init__ (a Dropout's seed state).
        scope = (
            variables_on(device)
            if device_exists(device)
            else _null_scope()
        )
        with scope:
            layer = keras.saving.deserialize_keras_object(
                config.pop("layer"), custom_objects=custom_objects
            )
        return cls(layer, device, **config)


def _null_scope():
    import contextlib

    return contextlib.nullcontext()


def _placed_gradients(tape, flat_outputs, output_grads, diff_args, variables):
    """(input gradients, variable gradients) from the forward pass's tape.

    Only floating outputs with an incoming gradient are differentiated;
    integer and non-trainable variables (seed states, BatchNormalization
    statistics, which `tf.custom_gradient` also reports) get None.
    """
    targets, target_grads = [], []
    for output, grad in zip(flat_outputs, output_grads, strict=True):
        if grad is not None and tf.as_dtype(output.dtype).is_floating:
            targets.append(output)
            target_grads.append(grad)
    wanted = [v for v in variables if _differentiable(v)]
    sources = list(diff_args) + wanted
    if targets:
        grads = tape.gradient(
            targets,
            sources,
            output_gradients=target_grads,
            unconnected_gradients=tf.UnconnectedGradients.ZERO,
        )
    else:
        grads = [tf.zeros_like(s) for s in sources]
    input_grads = list(grads[: len(diff_args)])
    by_ref = {
        v.ref(): g
        for v, g in zip(wanted, grads[len(diff_args) :], strict=True)
    }
    return input_grads, [by_ref.get(v.ref()) for v in variables]

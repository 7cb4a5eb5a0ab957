"""`PlacedLayer`: one layer whose variables and computation live on one
device, its backward pass included."""

from __future__ import annotations

import contextlib
import functools
import warnings
from typing import Any

from keras_mgpu._flavour import (
    check_flavour,
    keras_of,
    register_serializable,
    tf,
)
from keras_mgpu._layer_calls import accepts
from keras_mgpu.placement import micro_batch_groups
from keras_mgpu.placement.devices import (
    canonical_device,
    check_strategy,
    device_exists,
    variables_on,
)

# Placement is Keras 3 only, whatever TF_USE_LEGACY_KERAS says.
keras = keras_of("keras3")


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


def _differentiable(variable: Any) -> bool:
    return (
        bool(getattr(variable, "trainable", True))
        and tf.as_dtype(variable.dtype).is_floating
    )


@functools.partial(register_serializable, flavour="keras3")
class PlacedLayer(keras.layers.Layer):
    """Runs a layer on one device: its variables, its forward pass and its
    backward pass.

    `apply_placement` wraps every layer of a model in one of these (and
    every bare operation, such as the `x + y` of a functional residual
    connection, in a `PlacedOperation`); use it directly only to build a
    placed model by hand.

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
        layer: `keras.layers.Layer`. What to place (a layer, a
            `Sequential` block, a functional sub-model, a `RecomputeGrad`).
        device: str or `tf.config.LogicalDevice`, e.g. `"/gpu:1"`.
        **kwargs: base `Layer` arguments. `name` defaults to the wrapped
            layer's name (so a model's output names do not change) and
            `dtype` to its dtype policy.

    Example:

    ```python
    from keras_mgpu.placement import PlacedLayer, PlacedModel

    inputs = keras.Input((16,))
    x = PlacedLayer(keras.layers.Dense(64), "/cpu:0")(inputs)
    outputs = PlacedLayer(keras.layers.Dense(1), "/cpu:1")(x)
    model = PlacedModel(inputs, outputs)
    ```
    """

    # `_layer_calls.PLACED_MARK`: how `apply_recompute` (in `layers`, below
    # placement) recognises a placed layer without importing this class.
    _keras_mgpu_placed = True

    def __init__(self, layer: Any, device: Any, **kwargs: Any) -> None:
        check_flavour(layer, "layer", "keras3")
        if not isinstance(layer, keras.layers.Layer):
            raise TypeError(
                "Argument `layer` must be a Keras layer. "
                f"Received: layer={layer!r} (of type {type(layer).__name__})"
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
        super().__init__(**kwargs)
        self.layer = layer
        self.device = canonical_device(device, "device")
        self.supports_masking = bool(getattr(layer, "supports_masking", False))
        self.supports_jit = False
        # Pass inputs to the wrapped layer as they come (it converts them).
        self._convert_input_args = False
        self._allow_non_tensor_positional_args = True
        self._layer_accepts_mask = accepts(layer, "mask")
        self._layer_accepts_training = accepts(layer, "training")
        self._warned_missing = False

    def _scope(self):
        """Device scope for this layer: its device when it exists here."""
        if device_exists(self.device):
            return variables_on(self.device)
        if not self._warned_missing:
            self._warned_missing = True
            warnings.warn(
                f"PlacedLayer {self.name!r} was placed on {self.device}, "
                "which this process does not have; TensorFlow places it "
                "instead. Re-place the model for this machine: "
                "keras_mgpu.apply_placement(keras_mgpu.strip_placement("
                "model), devices=...).",
                stacklevel=3,
            )
        return contextlib.nullcontext()

    def build(self, *args: Any, **kwargs: Any) -> None:
        """Build the wrapped layer on the device when given its input
        shape(s); otherwise (Keras's automatic build) it builds itself on
        its first call, which runs on the device (see
        `compute_output_spec`). Keras hands a `*args` build no shapes, and
        only the wrapped layer knows how to map several inputs (an
        attention layer's query and value) to its own build."""
        check_strategy(f"building PlacedLayer {self.name!r}")
        layer = self.layer
        if args or kwargs:
            if not layer.built:
                with self._scope():
                    layer.build(*args, **kwargs)
                    layer.built = True
        self.built = True

    def _layer_kwargs(self, kwargs: dict, training=None, mask=None) -> dict:
        kwargs = dict(kwargs)
        if training is not None and self._layer_accepts_training:
            kwargs["training"] = training
        if mask is not None and self._layer_accepts_mask:
            kwargs["mask"] = mask
        return kwargs

    def compute_output_shape(self, *args: Any, **kwargs: Any) -> Any:
        return self.layer.compute_output_shape(*args, **kwargs)

    def compute_output_spec(
        self, inputs, *args, training=None, mask=None, **kwargs
    ):
        kwargs = self._layer_kwargs(kwargs, training, mask)
        layer = self.layer
        if not layer.built:
            # Keras builds functional models symbolically, eagerly: a
            # symbolic call builds the wrapped layer from its own inputs,
            # and its variables land on the device.
            with self._scope():
                outputs = layer(inputs, *args, **kwargs)
            return keras.tree.map_structure(
                lambda t: keras.KerasTensor(
                    t.shape, dtype=t.dtype, sparse=getattr(t, "sparse", False)
                ),
                outputs,
            )
        return layer.compute_output_spec(inputs, *args, **kwargs)

    def compute_mask(self, inputs: Any, mask: Any = None) -> Any:
        return self.layer.compute_mask(inputs, mask)

    def call(
        self, inputs: Any, *args: Any, training=None, mask=None, **kwargs: Any
    ) -> Any:
        check_strategy(f"calling PlacedLayer {self.name!r}")
        kwargs = self._layer_kwargs(kwargs, training, mask)
        slot = micro_batch_groups.register(self)
        with self._scope():
            return call_on_device(
                self.layer, (inputs, *args), kwargs, self.device, slot
            )

    def get_config(self) -> dict:
        config = super().get_config()
        config["layer"] = keras.saving.serialize_keras_object(self.layer)
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
            else contextlib.nullcontext()
        )
        with scope:
            layer = keras.saving.deserialize_keras_object(
                config.pop("layer"), custom_objects=custom_objects
            )
        return cls(layer, device, **config)


def call_on_device(
    layer: Any, args: tuple, kwargs: dict, device: str, slot: Any = None
) -> Any:
    """`layer(*args, **kwargs)` whose gradient is computed on `device`.

    A `tf.custom_gradient` over the floating tensors among the arguments
    (and the variables the layer reads); its gradient function
    differentiates a tape recorded during the forward pass, under
    `tf.device(device)`. Masks the layer attached to its outputs are put
    back on the returned tensors. With a micro-batch group `slot`, the
    variable gradients are summed there (see `micro_batch_groups`).
    """
    structure = (list(args), kwargs)
    flat = tf.nest.flatten(structure)
    diff_positions = [
        i
        for i, x in enumerate(flat)
        if tf.is_tensor(x) and tf.as_dtype(x.dtype).is_floating
    ]
    out_info: dict = {}

    def run_layer(diff_args):
        values = list(flat)
        for position, arg in zip(diff_positions, diff_args, strict=True):
            values[position] = arg
        call_args, call_kwargs = tf.nest.pack_sequence_as(structure, values)
        return layer(*call_args, **call_kwargs)

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
                if slot is not None:
                    output_grads = slot.after_previous(output_grads)
                input_grads, variable_grads = _placed_gradients(
                    tape, flat_outputs, output_grads, diff_args, variables
                )
                if slot is not None:
                    variable_grads = slot.add(variables, variable_grads)
            return input_grads, variable_grads

        return tuple(flat_outputs), grad_fn

    flat_results = tf.nest.flatten(forward(*[flat[i] for i in diff_positions]))
    for tensor, out_mask in zip(flat_results, out_info["masks"], strict=True):
        if out_mask is not None:
            _set_keras_mask(tensor, out_mask)
    return tf.nest.pack_sequence_as(out_info["structure"], flat_results)


@functools.partial(register_serializable, flavour="keras3")
class PlacedOperation(keras.Operation):
    """A bare operation of a functional graph (`x + y`, `ops.concatenate`
    on symbolic tensors) run on one device, its gradient too.

    The operation counterpart of `PlacedLayer` (operations take
    non-tensor arguments, such as the 0 of `ops.not_equal(ids, 0)`, which
    a layer's call cannot mix with tensors). `apply_placement` puts each
    on the device of the layer before it in graph order.

    Args:
        operation: `keras.Operation`.
        device: str, e.g. `"/gpu:1"`.
        name: defaults to the operation's name.
    """

    def __init__(
        self, operation: Any, device: Any, name: str | None = None
    ) -> None:
        if not isinstance(operation, keras.Operation):
            raise TypeError(
                "Argument `operation` must be a Keras operation. Received: "
                f"operation={operation!r} (of type {type(operation).__name__})"
            )
        super().__init__(name=name or operation.name)
        self.operation = operation
        self.device = canonical_device(device, "device")

    def call(self, *args: Any, **kwargs: Any) -> Any:
        check_strategy(f"calling PlacedOperation {self.name!r}")
        if not device_exists(self.device):
            return self.operation(*args, **kwargs)
        with tf.device(self.device):
            return call_on_device(self.operation, args, kwargs, self.device)

    def compute_output_spec(self, *args: Any, **kwargs: Any) -> Any:
        return self.operation.compute_output_spec(*args, **kwargs)

    def get_config(self) -> dict:
        return {
            "name": self.name,
            "operation": keras.saving.serialize_keras_object(self.operation),
            "device": self.device,
        }

    @classmethod
    def from_config(cls, config: dict, custom_objects=None) -> PlacedOperation:
        config = dict(config)
        operation = keras.saving.deserialize_keras_object(
            config.pop("operation"), custom_objects=custom_objects
        )
        return cls(operation, **config)


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
        v.ref(): g for v, g in zip(wanted, grads[len(diff_args) :], strict=True)
    }
    return input_grads, [by_ref.get(v.ref()) for v in variables]

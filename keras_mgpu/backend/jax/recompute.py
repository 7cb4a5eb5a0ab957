"""The recomputation engine on Keras's JAX backend, built on `jax.checkpoint`.

`recompute(forward, structure, state_layers)` is what `RecomputeGrad` and
`apply_recompute(..., in_place=True)` run a layer or a segment of layers
through on JAX (`keras_mgpu.layers._recompute_engine.recompute` dispatches
here). The region runs as a pure function of its arrays, the values of its
layers' variables and their seed states, checkpointed as a whole with
`jax.checkpoint`: the backward pass keeps only the region's inputs and
replays the traced forward to get the rest back.

Keras's JAX step runs the model under a `keras.StatelessScope` (variables
substituted by tracers, assignments collected by the scope). A checkpointed
function must not let its own tracers escape into that scope, so the region
runs in a scope of its own (`_RegionScope`): it reads the layers' variable
values from the function's arguments (others, if any, from the outer scope,
closed over), keeps every assignment (`Dropout`'s `SeedGenerator` state,
`BatchNormalization` moving statistics) and every loss added inside, and
hands them back as outputs; they are assigned and added outside the
checkpoint, once. The recomputation replays the traced forward with the same
arguments, so it draws the same dropout mask: gradients equal the plain
model's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from keras_mgpu._flavour import keras
from keras_mgpu.backend.layer_variables import unique_variables
from keras_mgpu.backend.masking import get_keras_mask, set_keras_mask


def _is_array(x: Any) -> bool:
    return isinstance(x, (jax.Array, np.ndarray))


def _is_traced(x: Any) -> bool:
    return isinstance(x, jax.core.Tracer)


def _is_floating(x: Any) -> bool:
    return jax.numpy.issubdtype(x.dtype, jax.numpy.floating)


# The name the offloaded activations carry inside a region (`checkpoint_name`)
# and the policy that sends exactly those to the host.
OFFLOADED_NAME = "keras_mgpu_offloaded"
_OFFLOAD_POLICY = jax.checkpoint_policies.save_and_offload_only_these_names(
    names_which_can_be_saved=[],
    names_which_can_be_offloaded=[OFFLOADED_NAME],
    offload_src="device",
    offload_dst="pinned_host",
)


# ---------------------------------------------------------------------------
# Private Keras hooks, each isolated in one function (read in Keras 3.15).
# ---------------------------------------------------------------------------


def _outer_scope() -> Any:
    """The `StatelessScope` in force (the JAX trainer's), or None."""
    from keras.src.backend.common.stateless_scope import get_stateless_scope

    return get_stateless_scope()


def _current_value(variable: Any, scope: Any) -> Any:
    """The value `variable` holds now, not autocast: the outer scope's
    substitute (a tracer inside Keras's jitted step) or the stored array.

    `Variable.value` would cast to the compute dtype inside a mixed-precision
    layer call; Keras 3.15 keeps the stored array in the private `_value`.
    """
    value = None if scope is None else scope.get_current_value(variable)
    return variable._value if value is None else value


def _losses_owned(layers: Sequence[Any], losses: Sequence[Any]) -> list:
    """For each loss a region added to its scope, the layer that added it
    (`Layer.add_loss` in a collecting scope records the loss's id in the
    private `_loss_ids`, Keras 3.15); the ids are dropped afterwards (they
    belong to tracers of the checkpoint's own trace)."""
    owners = []
    everyone = []
    seen = set()
    for layer in layers:
        for sub in layer._flatten_layers(include_self=True, recursive=True):
            if id(sub) not in seen:
                seen.add(id(sub))
                everyone.append(sub)
    for loss in losses:
        owner = None
        for sub in everyone:
            ids = getattr(sub, "_loss_ids", None)
            if ids is not None and id(loss) in ids:
                owner = sub
                ids.discard(id(loss))
                break
        owners.append(owner)
    return owners


class _RegionScope(keras.StatelessScope):
    """The scope a recomputed region runs in: its layers' variables read
    from the checkpointed function's arguments, any other variable from the
    scope outside (closed over); assignments and losses kept here."""

    def __init__(self, mapping: list, outer: Any) -> None:
        super().__init__(
            state_mapping=mapping,
            collect_losses=True,
            initialize_variables=False,
        )
        self._outer = outer
        self.updated: dict = {}

    def add_update(self, update: Any) -> None:
        super().add_update(update)
        variable, _ = update
        self.updated[id(variable)] = variable

    def get_current_value(self, variable: Any) -> Any:
        value = super().get_current_value(variable)
        if value is None and self._outer is not None:
            value = self._outer.get_current_value(variable)
        return value


# ---------------------------------------------------------------------------


def region_variables(layers: Sequence[Any]) -> list:
    """Every variable of `layers` and their sublayers (seed states and
    moving statistics included), each once."""
    return unique_variables(layers)


def _offloading(region: Callable) -> Callable:
    """`region` checkpointed with its first argument's floating arrays
    (the activations it starts from) saved in pinned host memory (JAX's
    `save_and_offload_only_these_names` policy): the forward moves them to
    the host, the backward brings them back before it replays the region.
    Nothing else inside is saved, as with a plain checkpoint."""

    def named(arrays, *rest):
        arrays = [
            checkpoint_name(x, OFFLOADED_NAME) if _is_floating(x) else x
            for x in arrays
        ]
        return region(arrays, *rest)

    return jax.checkpoint(named, policy=_OFFLOAD_POLICY)


def recompute(
    forward: Callable[[Any], Any],
    structure: Any,
    state_layers: Sequence[Any],
    offload: bool = False,
) -> Any:
    """`forward(structure)`, its activations recomputed in the backward pass.

    Arrays in `structure` (a nest of call arguments) are the checkpointed
    function's inputs; everything else (None, Python values) is passed as it
    is. Keras masks on the input arrays reach `forward`, and masks `forward`
    sets on its outputs reach the caller.

    Args:
        forward: the computation.
        structure: its arguments.
        state_layers: the layers `forward` runs; their variables (trainable
            weights, seed states, statistics) are the function's inputs, and
            their assignments and losses are applied outside it, once.

        offload: keep the region's input activations (its floating
            array arguments) in pinned host memory between the forward and
            the backward pass instead of on the device.

    There is no `again` (the TensorFlow engine's second computation for the
    backward pass): `jax.checkpoint` replays the traced forward itself.
    """
    flat = keras.tree.flatten(structure)
    positions = [i for i, x in enumerate(flat) if _is_array(x)]
    arrays = [flat[i] for i in positions]
    in_masks = [get_keras_mask(x) for x in arrays]
    outer = _outer_scope()
    variables = region_variables(state_layers)
    values = [_current_value(v, outer) for v in variables]

    traced = any(_is_traced(x) for x in arrays + values) or (
        outer is not None
        and any(_is_traced(x) for x in outer.state_mapping.values())
    )
    if not traced:
        # Nothing here can be differentiated (an eager call on concrete
        # arrays): run the region as it is.
        return forward(structure)

    info: dict = {}

    def region(arrays, in_masks, values):
        args = list(flat)
        for position, x, mask in zip(positions, arrays, in_masks, strict=True):
            if mask is not None:
                set_keras_mask(x, mask)
            args[position] = x
        mapping = list(zip(variables, values, strict=True))
        with _RegionScope(mapping, outer) as scope:
            outputs = forward(keras.tree.pack_sequence_as(structure, args))
        updated = list(scope.updated.values())
        losses = list(scope.losses)
        flat_out = keras.tree.flatten(outputs)
        out_positions = [i for i, x in enumerate(flat_out) if _is_array(x)]
        out_arrays = [flat_out[i] for i in out_positions]
        info["structure"] = outputs
        info["flat"] = flat_out
        info["positions"] = out_positions
        info["updated"] = updated
        info["owners"] = _losses_owned(state_layers, losses)
        out_masks = [get_keras_mask(x) for x in out_arrays]
        new_values = [scope.get_current_value(v) for v in updated]
        return out_arrays, out_masks, new_values, losses

    checkpointed = _offloading(region) if offload else jax.checkpoint(region)
    out_arrays, out_masks, new_values, losses = checkpointed(
        arrays, in_masks, values
    )
    for variable, value in zip(info["updated"], new_values, strict=True):
        variable.assign(value)
    for owner, loss in zip(info["owners"], losses, strict=True):
        (owner or state_layers[0]).add_loss(loss)
    flat_out = list(info["flat"])
    for position, x, mask in zip(
        info["positions"], out_arrays, out_masks, strict=True
    ):
        if mask is not None:
            set_keras_mask(x, mask)
        flat_out[position] = x
    return keras.tree.pack_sequence_as(info["structure"], flat_out)


__all__ = ["OFFLOADED_NAME", "recompute", "region_variables"]

"""`convert_batchnorm_to_groupnorm` (re-exported by `conversions`, its
public path): how many groups a layer gets, and the rebuilt model with
GroupNormalization in place of every BatchNormalization."""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

from keras_mgpu._validation import check_int
from keras_mgpu.backend import require_backend
from keras_mgpu.normalization._conversion_common import (
    _keras_for,
    _layers_or_warn,
)
from keras_mgpu.normalization._find import (
    batchnorm_layers,
    is_batchnorm,
)

# The logger of `conversions`, where this function is public.
logger = logging.getLogger("keras_mgpu.normalization.conversions")

# Below this many values per group and example, a GroupNormalization
# output keeps little of its input (2 values normalise to -1 and +1), and
# a network whose narrow layers normalise so few barely trains: measured,
# MobileNetV2 0.35 on 32x32 digits (1x1 and 2x2 maps at the end, groups
# of 2-4 values) reached 14% after 100 updates (Adam 5e-4, batch 64,
# seed 0), 73% with groups of 16 or more values; the benchmark's
# --min-values-per-group compares the two. `convert_batchnorm_to_groupnorm`
# takes fewer groups where that keeps at least this many, and warns where
# even one group holds fewer.
MIN_VALUES_PER_GROUP = 16


# ----------------------------------------------------------------------
# convert_batchnorm_to_groupnorm
# ----------------------------------------------------------------------
def _channel_axis(layer: Any) -> int:
    axis = layer.axis
    if isinstance(axis, (list, tuple)):
        if len(axis) != 1:
            raise ValueError(
                f"BatchNormalization layer {layer.name!r} normalises over "
                f"several axes (axis={list(axis)}); GroupNormalization takes "
                "one channel axis. Convert such a layer yourself."
            )
        axis = axis[0]
    return int(axis)


def _input_shape(layer: Any) -> tuple:
    shape = getattr(layer, "_build_shapes_dict", None)
    if shape:  # Keras 3
        return tuple(next(iter(shape.values())))
    shape = getattr(layer, "_build_input_shape", None)  # tf_keras
    if shape is not None:
        return tuple(getattr(shape, "as_list", lambda: shape)())
    try:
        return tuple(layer.input.shape)
    except (AttributeError, ValueError, RuntimeError):
        return ()


def choose_groups(
    channels: int,
    groups: int,
    values_per_channel: int,
    min_values: int = MIN_VALUES_PER_GROUP,
) -> int:
    """The number of groups for `channels` channels: the largest divisor of
    `channels` that is <= `groups` and leaves each group at least
    `min_values` values per example (`values_per_channel` is the product
    of the other non-batch dimensions; 1 for a `(batch, channels)` input);
    if none does, 1 (every channel in one group: the most values there
    are); 0 if that is a single value, which normalises to 0 whatever the
    input."""
    if channels * values_per_channel < 2:
        return 0
    for candidate in range(min(groups, channels), 0, -1):
        if channels % candidate:
            continue
        if (channels // candidate) * values_per_channel >= min_values:
            return candidate
    return 1


def _groupnorm_for(
    layer: Any, keras: Any, groups: int, min_values: int
) -> tuple:
    """A GroupNormalization equivalent of BatchNormalization `layer` (not
    built) and what was chosen: (layer, report row)."""
    shape = _input_shape(layer)
    axis = _channel_axis(layer)
    if not shape:
        raise ValueError(
            f"BatchNormalization layer {layer.name!r} is not built: its "
            "channel count is unknown. Build the model (call it once or "
            "give it an Input) before converting."
        )
    rank = len(shape)
    axis = axis % rank
    channels = shape[axis]
    others = [d for i, d in enumerate(shape) if i not in (0, axis)]
    # Unknown spatial sizes (None) are taken as large enough.
    values_per_channel = (
        math.prod(others) if all(d is not None for d in others) else min_values
    )
    chosen = choose_groups(
        int(channels), groups, values_per_channel, min_values
    )
    if chosen == 0:
        raise ValueError(
            f"BatchNormalization layer {layer.name!r} sees one value per "
            f"example (input shape {shape}): GroupNormalization would "
            "normalise it to 0. Leave this layer out (e.g. freeze it) or "
            "replace it yourself."
        )
    config = layer.get_config()
    new = keras.layers.GroupNormalization(
        groups=chosen,
        axis=axis if axis != rank - 1 else -1,
        epsilon=config["epsilon"],
        center=config["center"],
        scale=config["scale"],
        beta_initializer=config["beta_initializer"],
        gamma_initializer=config["gamma_initializer"],
        beta_regularizer=config["beta_regularizer"],
        gamma_regularizer=config["gamma_regularizer"],
        beta_constraint=config["beta_constraint"],
        gamma_constraint=config["gamma_constraint"],
        name=layer.name,
        trainable=layer.trainable,
        dtype=config.get("dtype"),
    )
    row = {
        "layer": layer.name,
        "channels": int(channels),
        "groups": chosen,
        "values_per_group": (
            (int(channels) // chosen) * values_per_channel
            if all(d is not None for d in others)
            else None
        ),
    }
    return new, row


def _is_graph_model(model: Any, keras: Any) -> bool:
    """Sequential or functional (what `clone_model` rebuilds with a
    `clone_function`): a model built from a graph of layers, whatever
    class it was given."""
    if not isinstance(model, keras.Model):
        return False
    if keras.__name__ == "tf_keras":
        return bool(getattr(model, "_is_graph_network", False))
    from keras.src.models.functional import Functional

    return isinstance(model, (keras.Sequential, Functional))


def _check_groups(groups: object) -> int:
    return check_int(groups, "groups", minimum=1)


def _copy_weights(source: Any, target: Any) -> None:
    old, new = source.weights, target.weights
    if [tuple(w.shape) for w in old] != [tuple(w.shape) for w in new]:
        raise ValueError(  # pragma: no cover - a bug, not user input
            f"Copying layer {source.name!r} changed its weights; cannot "
            "copy them."
        )
    target.set_weights(source.get_weights())


def _convert(
    model: Any, keras: Any, groups: int, min_values: int, report: list
) -> Any:
    mapping: dict = {}  # id(original layer) -> (original, copy)
    replacements: set = set()  # ids of the new GroupNormalization layers

    def clone_function(layer: Any) -> Any:
        if id(layer) in mapping:  # a shared layer stays shared
            return mapping[id(layer)][1]
        if is_batchnorm(layer):
            new, row = _groupnorm_for(layer, keras, groups, min_values)
            report.append(row)
            replacements.add(id(new))
        elif _is_graph_model(layer, keras):
            new = _convert(layer, keras, groups, min_values, report)
        else:
            inner = batchnorm_layers(layer)
            if inner:
                raise ValueError(
                    f"Layer {layer.name!r} ({type(layer).__name__}) holds "
                    f"BatchNormalization layers ({inner[0].name!r}, ...) "
                    "that only its own code creates; "
                    "convert_batchnorm_to_groupnorm can replace layers of "
                    "Sequential and functional models (nested ones "
                    "included), not inside custom layers."
                )
            new = layer.__class__.from_config(layer.get_config())
        mapping[id(layer)] = (layer, new)
        return new

    kwargs = {}
    if keras.__name__ != "tf_keras" and not isinstance(model, keras.Sequential):
        # Keras 3 replays each node's call arguments: BatchNormalization's
        # `mask` goes to a GroupNormalization, whose `call` takes none.
        def call_function(layer: Any, *args: Any, **call_kwargs: Any) -> Any:
            if id(layer) in replacements:
                call_kwargs.pop("mask", None)
            return layer(*args, **call_kwargs)

        kwargs["call_function"] = call_function
    clone = keras.models.clone_model(
        model, clone_function=clone_function, **kwargs
    )
    for old, new in mapping.values():
        if is_batchnorm(old):
            if old.scale:
                new.gamma.assign(old.gamma.numpy())
            if old.center:
                new.beta.assign(old.beta.numpy())
        elif not _is_graph_model(old, keras):
            _copy_weights(old, new)
    return clone


def convert_batchnorm_to_groupnorm(
    model: Any,
    *,
    groups: int = 32,
    min_values_per_group: int = MIN_VALUES_PER_GROUP,
) -> Any:
    """Return a copy of `model` with every BatchNormalization layer replaced
    by a GroupNormalization layer.

    GroupNormalization normalises each example on its own, over groups of
    channels, so it behaves the same for any batch split: micro-batches
    of gradient accumulation and pipelining, replicas, even batch size 1,
    with no communication and nothing to synchronise. It is the
    from-scratch answer (Wu & He, 2018); a network pretrained with
    BatchNormalization changes its function (fine-tune it, or prefer
    `freeze_batchnorm`).

    Each replacement has the same name, channel axis, `epsilon`,
    `center`/`scale` (with `gamma` and `beta` copied), initializers,
    regularizers, constraints, `trainable` flag and dtype policy, and
    `groups` = the largest divisor of the layer's channel count that is
    `<= groups` and leaves each group at least `min_values_per_group`
    values per example (channels per group times the other non-batch
    dimensions: a `(batch, 4, 4, 64)` input gets 32 groups of 2 x 16
    values, a `(batch, 1, 1, 56)` one 2 groups of 28 x 1 with the default
    16), or one group where no divisor does (with a UserWarning). Groups
    of few values keep little of their input (2 values normalise to -1
    and +1): with `groups=32` on every layer, MobileNetV2 0.35 at 32 x 32
    (whose last layers see 1 x 1 and 2 x 2 maps) reached 14 % on digits
    after 100 updates, 73 % with the default. A
    layer that sees one value per example raises a ValueError. The moving
    mean and variance are dropped:
    GroupNormalization has none, and it computes at inference what it
    computes in training. Every other layer is a fresh copy with its
    weights copied exactly. The groups chosen are logged (logger
    `keras_mgpu.normalization.conversions`, INFO) and readable on the new
    layers (`layer.groups`).

    Sequential and functional models are rebuilt with
    `keras.models.clone_model`, nested Sequential/functional models too;
    shared layers stay shared. A subclassed model, or a custom layer
    that creates BatchNormalization layers in its own code, raises a
    ValueError. A model without BatchNormalization comes back as a copy
    (with a UserWarning). The copy is neither compiled nor marked:
    compile it yourself.

    Under `tf.distribute`: call it inside `strategy.scope()` so that the
    new variables are created there (as for any model).

    Args:
        model: a built Keras 3 or tf_keras Sequential or functional model.
        groups: int >= 1 (default 32, the paper's): the most groups per
            layer.
        min_values_per_group: int >= 2 (default 16): the fewest values per
            group and example a layer's choice keeps where its channels
            allow; 2 gives the largest divisor `<= groups` (the paper's
            rule) everywhere a group holds more than one value.

    Returns:
        A new model of the same flavour.

    Example:

    ```python
    model = keras.applications.ResNet50(weights=None)
    model = keras_mgpu.normalization.convert_batchnorm_to_groupnorm(model)
    model.compile("sgd", "sparse_categorical_crossentropy")
    ```
    """
    require_backend("convert_batchnorm_to_groupnorm")
    keras = _keras_for(model)
    groups = _check_groups(groups)
    min_values = check_int(
        min_values_per_group, "min_values_per_group", minimum=2
    )
    if not _is_graph_model(model, keras):
        raise ValueError(
            "Argument `model` must be a Sequential or functional Keras "
            "model (convert_batchnorm_to_groupnorm rebuilds it with "
            "`keras.models.clone_model`); a subclassed model's layers are "
            "created by its own code, so change its BatchNormalization "
            "layers there. Received: model of type "
            f"{type(model).__name__}"
        )
    if not model.built:
        raise ValueError(
            "Argument `model` must be built (give it an Input or call it "
            f"once) before conversion. Received: model={model.name!r}"
        )
    _layers_or_warn(model, "convert_batchnorm_to_groupnorm")
    report: list = []
    converted = _convert(model, keras, groups, min_values, report)
    few = [
        f"{row['layer']} ({row['values_per_group']})"
        for row in report
        if row["values_per_group"] is not None
        and row["values_per_group"] < min_values
    ]
    if few:
        warnings.warn(
            "convert_batchnorm_to_groupnorm: these GroupNormalization "
            f"layers normalise fewer than {min_values} values per group and "
            f"example even as one group: {', '.join(few)}. Their output "
            "keeps little of the input; leave such layers out (freeze "
            "them) or normalise them another way.",
            UserWarning,
            stacklevel=2,
        )
    for row in report:
        logger.info(
            "convert_batchnorm_to_groupnorm: %s (%d channels) -> "
            "GroupNormalization(groups=%d), %s values per group",
            row["layer"],
            row["channels"],
            row["groups"],
            row["values_per_group"],
        )
    return converted


__all__ = [
    "MIN_VALUES_PER_GROUP",
    "choose_groups",
    "convert_batchnorm_to_groupnorm",
]

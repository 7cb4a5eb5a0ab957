"""Remedies for BatchNormalization on split batches: synchronise it across
replicas, freeze it, replace it with GroupNormalization, or accept the
per-micro-batch statistics knowingly.

`synchronize_batchnorm`, `freeze_batchnorm` and
`accept_micro_batch_statistics` change the model's layers in place and are
undone by calling them again with their flag `False` (e.g.
`frozen=False`); `convert_batchnorm_to_groupnorm` returns a new model.
Each records its choice on the layers
(`keras_mgpu.normalization._find.mark_choice`), which silences the
`BatchNormMicroBatchWarning` where the choice addresses micro-batches.
"""

from __future__ import annotations

import logging
import math
import sys
import warnings
from typing import Any

from keras_mgpu._flavour import TF_RUNS, keras_of, object_flavour
from keras_mgpu._validation import check_int
from keras_mgpu.backend import require_backend
from keras_mgpu.normalization._find import (
    batchnorm_layers,
    choice_after_undo,
    choice_of,
    is_batchnorm,
    mark_choice,
    pop_saved,
    saved,
)
from keras_mgpu.normalization.window_statistics import (
    base_class,
    set_base_class,
)

logger = logging.getLogger(__name__)

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
# Shared helpers
# ----------------------------------------------------------------------
def _check_bool(value: object, argument: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(
            f"Argument `{argument}` must be True or False. Received: "
            f"{argument}={value!r} (of type {type(value).__name__})"
        )
    return value


def _keras_for(model: object, argument: str = "model") -> Any:
    """The Keras package `model` belongs to, or a TypeError when it is not
    a Keras layer or model of either flavour."""
    flavour = object_flavour(model)
    if flavour in ("keras3", "tf_keras"):
        keras = keras_of(flavour)
        if isinstance(model, keras.layers.Layer):
            return keras
    raise TypeError(
        f"Argument `{argument}` must be a Keras model or layer (Keras 3 or "
        f"tf_keras). Received: {argument}={model!r} (of type "
        f"{type(model).__name__})"
    )


def _layers_or_warn(model: Any, function: str) -> list:
    """The BatchNormalization layers of `model`; a UserWarning (and an
    empty list) when it has none: the call is then a no-op, most likely
    on the wrong object (e.g. a layer whose sublayers Keras does not
    track)."""
    layers = batchnorm_layers(model)
    if not layers:
        warnings.warn(
            f"`{function}`: model {getattr(model, 'name', model)!r} has no "
            "BatchNormalization layers (nested models and tracked "
            "sublayers included); nothing was changed.",
            UserWarning,
            stacklevel=3,
        )
    return layers


def _refresh_compiled(model: Any) -> None:
    """Make a compiled model (and compiled models inside it) trace its
    step functions anew, with the layers' current flags.

    Both flavours read a layer's `trainable` and BatchNormalization's
    `synchronized` when they trace `train_function`, and cache the traced
    function: without this, a change after `fit` started takes effect only
    after `compile` again. Private API, isolated here (Keras 3.10-3.15:
    `train_function`/`test_function`/`predict_function` and the
    `_compiled_trainable_state` that `fit` compares against to warn;
    tf_keras 2.15-2.21: `_reset_compile_cache`, which also records the
    trainable state that its `fit` would otherwise restore).
    """
    models = [model] + [
        layer
        for layer in model._flatten_layers(include_self=False, recursive=True)
        if hasattr(layer, "make_train_function")
    ]
    for each in models:
        if not hasattr(each, "make_train_function"):
            continue
        reset = getattr(each, "_reset_compile_cache", None)
        if reset is not None:  # tf_keras
            if getattr(each, "_is_compiled", False):
                reset()
            continue
        if not getattr(each, "compiled", False):
            continue
        each.train_function = None
        each.test_function = None
        each.predict_function = None
        if hasattr(each, "_compiled_trainable_state"):
            each._compiled_trainable_state = {
                layer: layer.trainable for layer in each._flatten_layers()
            }


def _unknown_to_optimizer(model: Any, variables: list) -> list:
    """Those of `variables` that the compiled model's optimizer, already
    built, was not built with (it refuses to update them: Keras 3 raises
    "Unknown variable", tf_keras a KeyError). Private API, isolated here
    (Keras 3.10-3.15: `_trainable_variables`; tf_keras 2.15-2.21:
    `_var_key` and `_index_dict`); [] when it cannot tell."""
    optimizer = getattr(model, "optimizer", None)
    try:
        if optimizer is None:
            return []
        if hasattr(optimizer, "_index_dict"):  # tf_keras
            if not getattr(optimizer, "_built", False):
                return []
            known = optimizer._index_dict
            return [v for v in variables if optimizer._var_key(v) not in known]
        if not optimizer.built:
            return []
        known_ids = {id(v) for v in optimizer._trainable_variables}
        return [v for v in variables if id(v) not in known_ids]
    except Exception:  # noqa: BLE001 - only a hint
        return []


# ----------------------------------------------------------------------
# synchronize_batchnorm
# ----------------------------------------------------------------------
def _tf_keras_sync_class() -> type | None:
    if "tf_keras" not in sys.modules:
        return None
    from tf_keras.src.layers.normalization import batch_normalization

    return batch_normalization.SyncBatchNormalization


def _tf_keras_plain_class() -> type | None:
    if "tf_keras" not in sys.modules:
        return None
    from tf_keras.src.layers.normalization import batch_normalization

    return batch_normalization.BatchNormalization


def _set_synchronized(layer: Any, keras: Any) -> None:
    records = saved(layer)
    if "synchronized" not in records:
        record = {
            "synchronized": layer.synchronized,
            "choice": choice_of(layer),
        }
        if keras.__name__ == "tf_keras":
            record["fused"] = layer.fused
            record["class"] = base_class(layer)
        records["synchronized"] = record
    layer.synchronized = True
    if keras.__name__ == "tf_keras":
        # tf_keras's fused kernel computes local moments only; the
        # unfused path asks `_calculate_mean_and_var`, which reads
        # `synchronized` at call time.
        layer.fused = False
        # tf_keras 2.21's `BatchNormalization.get_config` leaves out
        # `synchronized`: a saved model would load unsynchronized. Its own
        # `SyncBatchNormalization` (same base, no state of its own) is
        # saved under its name and loads synchronized, without keras_mgpu
        # (with window statistics: `WindowSyncBatchNormalization`).
        if base_class(layer) is _tf_keras_plain_class():
            set_base_class(layer, _tf_keras_sync_class())
    if choice_of(layer) is None:
        # A micro-batch choice made before stays: synchronising addresses
        # replicas only.
        mark_choice(layer, "synchronized")


def _unset_synchronized(layer: Any, keras: Any) -> None:
    record = pop_saved(layer, "synchronized")
    if record is None:
        # No record (e.g. loaded from a file): the layer's default.
        layer.synchronized = False
        if keras.__name__ == "tf_keras" and base_class(layer) is (
            _tf_keras_sync_class()
        ):
            set_base_class(layer, _tf_keras_plain_class())
        record = {}
    else:
        layer.synchronized = record["synchronized"]
        if "fused" in record:
            layer.fused = record["fused"]
            set_base_class(layer, record["class"])
    if choice_of(layer) == "synchronized":
        mark_choice(layer, choice_after_undo(layer, record.get("choice")))


def synchronize_batchnorm(model: Any, *, synchronized: bool = True) -> Any:
    """Make every BatchNormalization layer of `model` compute its batch
    statistics over all replicas (in place) under `tf.distribute`; on JAX
    they already do, and nothing changes.

    Each BatchNormalization layer (nested models and tracked sublayers
    included, both Keras flavours) normalises with the mean and variance of
    the *global* batch, all-reduced across the replicas of the
    `tf.distribute` strategy at every training step, and updates its
    moving statistics with them: Keras 3's
    `BatchNormalization(synchronized=True)`, tf_keras's
    `SyncBatchNormalization`. The change is part of the layer's config, so
    `get_config`, `clone_model` and `.keras` files keep it (tf_keras:
    the layer becomes a `SyncBatchNormalization`, because tf_keras's
    `BatchNormalization.get_config` drops `synchronized`).

    **What it fixes.** Replicas: without it each replica normalises its
    share of the batch (its own statistics, its own moving-statistics
    update, kept only on that replica until saved). It does *not* change
    micro-batches of gradient accumulation or pipelining, which follow one
    another in time; see `freeze_batchnorm`,
    `convert_batchnorm_to_groupnorm`, `use_window_statistics` and
    `accept_micro_batch_statistics` for those. A layer with no choice yet
    is marked "synchronized" (a micro-batch choice already made stays).

    **Cost.** Three small all-reduces (sum, sum of squares, count: one
    value per channel each) per layer per training step, in the forward
    pass. Measured in `benchmarks/bench_batchnorm_sync.py`. Without a
    replicated strategy the layer behaves as before. Keras 3 ignores
    `synchronized` for masked inputs (its masked moments are local).

    **Compiled models.** The step functions are traced anew at the next
    `fit`/`evaluate`/`predict`; no need to compile again.

    **With window statistics** (`use_window_statistics`): either order,
    undone in either order; the window then weighs each micro-batch by its
    global size, so every replica's moving statistics are the global large
    batch's, even when batches split unevenly across replicas. tf_keras:
    a switched layer becomes a `WindowSyncBatchNormalization` (registered
    under `keras_mgpu`), and back.

    **On JAX (`keras.distribution`) it is a no-op.** Keras's JAX trainer
    jits the step for the whole global batch: under `DataParallel`, and
    under `ModelParallel` with a batch axis, BatchNormalization's mean and
    variance are taken over the global batch (XLA inserts the
    cross-device reductions) and every device's moving statistics equal
    those of one device on the same global batch (tested to 1e-6). So
    there is nothing to synchronise: the layers are only marked
    "synchronized" (undone with `synchronized=False`), their
    `synchronized` attribute stays as it is (Keras refuses
    `synchronized=True` off TensorFlow), and an INFO log
    (logger `keras_mgpu.normalization.conversions`) says so. The same
    model code thus runs on both backends.

    Args:
        model: a Keras 3 or tf_keras model or layer.
        synchronized: bool (default True). False undoes the call: each
            layer gets back the state it had before (a layer with no
            record, e.g. loaded from a file, becomes unsynchronized).

    Returns:
        `model`, changed in place.

    Example:

    ```python
    strategy = tf.distribute.MirroredStrategy()
    with strategy.scope():
        model = keras.applications.ResNet50(weights=None)
        keras_mgpu.normalization.synchronize_batchnorm(model)
        model.compile("sgd", "sparse_categorical_crossentropy")
    model.fit(dataset)
    ```
    """
    require_backend("synchronize_batchnorm")
    keras = _keras_for(model)
    synchronized = _check_bool(synchronized, "synchronized")
    layers = _layers_or_warn(model, "synchronize_batchnorm")
    if not TF_RUNS:
        _mark_synchronized_only(layers, synchronized)
        return model
    for layer in layers:
        if synchronized:
            _set_synchronized(layer, keras)
        else:
            _unset_synchronized(layer, keras)
    if layers:
        _refresh_compiled(model)
    return model


def _mark_synchronized_only(layers: list, synchronized: bool) -> None:
    """`synchronize_batchnorm` where TensorFlow does not run (JAX): the
    jitted step of `keras.distribution` computes BatchNormalization's
    statistics over the global batch already; record the choice only."""
    for layer in layers:
        if synchronized:
            saved(layer).setdefault(
                "synchronized", {"choice": choice_of(layer)}
            )
            if choice_of(layer) is None:
                mark_choice(layer, "synchronized")
            continue
        record = pop_saved(layer, "synchronized") or {}
        if choice_of(layer) == "synchronized":
            mark_choice(layer, choice_after_undo(layer, record.get("choice")))
    if synchronized and layers:
        logger.info(
            "synchronize_batchnorm: nothing to do on the JAX backend: under "
            "keras.distribution (DataParallel, or ModelParallel with a "
            "batch axis) BatchNormalization already uses the global "
            "batch's statistics; %d layer(s) marked 'synchronized'.",
            len(layers),
        )


# ----------------------------------------------------------------------
# freeze_batchnorm
# ----------------------------------------------------------------------
def freeze_batchnorm(model: Any, *, frozen: bool = True) -> Any:
    """Freeze every BatchNormalization layer of `model` (in place): the
    fine-tuning answer to small or split batches.

    Each BatchNormalization layer (nested models and tracked sublayers
    included, both Keras flavours) gets `trainable=False`. Both flavours
    then run it in inference mode even in `fit`: it normalises with its
    moving statistics, which stop changing, and its `gamma`/`beta` are not
    trained. Micro-batches and replicas therefore no longer matter: every
    micro-batch is normalised the same way, and there is nothing to
    synchronise. Use it when fine-tuning a pretrained network whose moving
    statistics are already good (Keras's transfer-learning guide does the
    same); from scratch the statistics never get learned. Layers are
    marked "frozen".

    **Compiled models.** Keras records trainable flags at `compile` (Keras
    3 warns at `fit` when they changed; tf_keras's `fit` silently restores
    the compiled flags). This function makes the change take effect at
    the next `fit` without compiling again: it has the compiled step
    functions traced anew and updates Keras's record of the compiled
    flags. Pass the model you compiled (or a model inside it that is
    compiled itself). On JAX, freeze before the first `fit` (compiling
    before is fine): Keras's JAX trainer needs the optimizer built with
    exactly the trainable variables, so after a `fit` a UserWarning asks
    to compile again with a new optimizer. The optimizer keeps its
    state for `gamma`/`beta`; they simply receive no more gradients.

    Args:
        model: a Keras 3 or tf_keras model or layer.
        frozen: bool (default True). False undoes the call: each layer gets
            back the `trainable` flag it had before (a layer with no
            record, e.g. loaded from a file, becomes trainable). If the
            optimizer was built while the layers were frozen (the first
            `fit` came after freezing), it cannot update them: a
            UserWarning says so; compile again with a new optimizer.

    Returns:
        `model`, changed in place.

    Example:

    ```python
    base = keras.applications.MobileNetV2(include_top=False)
    model = keras.Sequential([base, keras.layers.GlobalAveragePooling2D(),
                              keras.layers.Dense(10)])
    keras_mgpu.normalization.freeze_batchnorm(model)
    model.compile(
        keras_mgpu.GradientAccumulationOptimizer(
            keras.optimizers.SGD(0.01), accumulation_steps=8),
        "sparse_categorical_crossentropy")
    ```
    """
    require_backend("freeze_batchnorm")
    _keras_for(model)
    frozen = _check_bool(frozen, "frozen")
    layers = _layers_or_warn(model, "freeze_batchnorm")
    was_trainable = [v for layer in layers for v in layer.trainable_weights]
    for layer in layers:
        if frozen:
            saved(layer).setdefault(
                "frozen",
                {"trainable": layer.trainable, "choice": choice_of(layer)},
            )
            layer.trainable = False
            mark_choice(layer, "frozen")
        else:
            # No record (e.g. loaded from a file): trainable.
            record = pop_saved(layer, "frozen") or {"trainable": True}
            layer.trainable = record["trainable"]
            if choice_of(layer) == "frozen":
                mark_choice(
                    layer, choice_after_undo(layer, record.get("choice"))
                )
    if layers:
        _refresh_compiled(model)
    if frozen and not TF_RUNS:
        _warn_jax_optimizer_built(model, was_trainable)
    if not frozen:
        unknown = _unknown_to_optimizer(
            model, [v for layer in layers for v in layer.trainable_weights]
        )
        if unknown:
            warnings.warn(
                "`freeze_batchnorm(model, frozen=False)`: the model's "
                "optimizer was "
                "built while the BatchNormalization layers were frozen and "
                f"cannot update {len(unknown)} of their variables "
                f"({unknown[0].name}, ...). Compile the model again, with a "
                "new optimizer, before `fit`.",
                UserWarning,
                stacklevel=2,
            )
    return model


def _warn_jax_optimizer_built(model: Any, variables: list) -> None:
    """On JAX, Keras's trainer hands the optimizer exactly the model's
    trainable variables, which must be those it was built with (Keras 3.15
    `BaseOptimizer.stateless_apply` raises otherwise): an optimizer built
    with the layers' `gamma`/`beta` (a `fit` ran before freezing) cannot
    train the frozen model."""
    known = len(variables) - len(_unknown_to_optimizer(model, variables))
    optimizer = getattr(model, "optimizer", None)
    if not known or optimizer is None or not optimizer.built:
        return
    warnings.warn(
        "`freeze_batchnorm(model)` on JAX: the model's optimizer was built "
        f"(by a `fit`) with {known} variables of the BatchNormalization "
        "layers now frozen; Keras's JAX trainer requires the optimizer's "
        "variables to match the trainable ones. Compile the model again, "
        "with a new optimizer, before `fit` (or freeze before the first "
        "`fit`).",
        UserWarning,
        stacklevel=3,
    )


# ----------------------------------------------------------------------
# accept_micro_batch_statistics
# ----------------------------------------------------------------------
def accept_micro_batch_statistics(model: Any, *, accepted: bool = True) -> Any:
    """Say that per-micro-batch BatchNormalization is what you want: marks
    every BatchNormalization layer of `model` "accepted", which silences
    `BatchNormMicroBatchWarning` for it. Nothing else changes.

    Under gradient accumulation (K micro-batches per update) and pipeline
    micro-batches (M per step), each micro-batch is normalised with its
    own statistics and the moving statistics move once per micro-batch.
    That is often fine when micro-batches are large (say 32 examples and
    more per replica), and it is what Keras's own
    `gradient_accumulation_steps` does.

    Args:
        model: a Keras 3 or tf_keras model or layer.
        accepted: bool (default True). False removes the "accepted" mark.

    Returns:
        `model` (the layers are marked in place).

    Example:

    ```python
    keras_mgpu.normalization.accept_micro_batch_statistics(model)
    ```
    """
    require_backend("accept_micro_batch_statistics")
    _keras_for(model)
    accepted = _check_bool(accepted, "accepted")
    for layer in _layers_or_warn(model, "accept_micro_batch_statistics"):
        if accepted:
            mark_choice(layer, "accepted")
        elif choice_of(layer) == "accepted":
            mark_choice(layer, None)
    return model


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
    "accept_micro_batch_statistics",
    "convert_batchnorm_to_groupnorm",
    "freeze_batchnorm",
    "synchronize_batchnorm",
]

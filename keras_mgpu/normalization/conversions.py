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
import sys
import warnings
from typing import Any

from keras_mgpu._flavour import TF_RUNS
from keras_mgpu.backend import require_backend
from keras_mgpu.normalization._conversion_common import (
    _check_bool,
    _keras_for,
    _layers_or_warn,
    _refresh_compiled,
    _unknown_to_optimizer,
)
from keras_mgpu.normalization._find import (
    choice_after_undo,
    choice_of,
    mark_choice,
    pop_saved,
    saved,
)
from keras_mgpu.normalization._groupnorm import (
    MIN_VALUES_PER_GROUP,
    choose_groups,
    convert_batchnorm_to_groupnorm,
)
from keras_mgpu.normalization.window_statistics import (
    base_class,
    set_base_class,
)

logger = logging.getLogger(__name__)

__all__ = [
    "MIN_VALUES_PER_GROUP",
    "accept_micro_batch_statistics",
    "choose_groups",
    "convert_batchnorm_to_groupnorm",
    "freeze_batchnorm",
    "synchronize_batchnorm",
]


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

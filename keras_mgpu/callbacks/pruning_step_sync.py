"""`PruningStepSync`: TFMOT's pruning step counts optimizer updates."""

from __future__ import annotations

from typing import Any

from keras_mgpu._flavour import IS_TF_KERAS, keras, tf
from keras_mgpu.backend import require_backend

_TFMOT_HINT = (
    "Install TensorFlow Model Optimization with: "
    'pip install "keras-mgpu[tfmot]"'
)


def _prune_low_magnitude_class() -> type:
    """TFMOT's pruning wrapper class, imported on first use.

    TFMOT 0.8 exports no public class for it (`prune_low_magnitude` returns
    instances of `pruning_wrapper.PruneLowMagnitude`); its own
    `UpdatePruningStep` imports it from the same module.
    """
    try:
        from tensorflow_model_optimization.python.core.sparsity.keras import (
            pruning_wrapper,
        )
    except ImportError as exc:
        raise ImportError(
            f"PruningStepSync needs tensorflow-model-optimization. "
            f"{_TFMOT_HINT}"
        ) from exc
    return pruning_wrapper.PruneLowMagnitude


def _steps_per_execution(model: Any) -> int:
    """`steps_per_execution` of a compiled tf_keras 2.x model (private
    `_steps_per_execution` variable, tf_keras 2.11-2.21)."""
    value = getattr(model, "_steps_per_execution", None)
    return 1 if value is None else int(keras.backend.get_value(value))


class PruningStepSync(keras.callbacks.Callback):
    """Makes TFMOT pruning schedules count optimizer updates.

    A drop-in replacement for `tfmot.sparsity.keras.UpdatePruningStep`
    (use one or the other). TFMOT's `PruneLowMagnitude` layer advances its
    `pruning_step` on every training forward pass, so with
    `GradientAccumulationOptimizer(..., accumulation_steps=K)` a pruning
    schedule would count micro-batches: it would reach `end_step` after
    `end_step / K` updates and prune on weights that had not moved. This
    callback sets every pruning layer's `pruning_step` from
    `model.optimizer.iterations` (optimizer *updates*) before each batch, so
    during the micro-batches of update `u` the schedule sees step `u + 1`:
    exactly what `UpdatePruningStep` gives without accumulation, and the
    same again on resumption from a checkpoint (the count comes from the
    optimizer's state). Masks are recomputed on each micro-batch of a
    window from the same weights, which gives the same mask. At the end of
    each epoch weights are re-masked, as `UpdatePruningStep` does.

    It also finds pruning layers nested in other layers (e.g. in a
    `keras_mgpu.layers.RecomputeGrad` block), which `UpdatePruningStep`
    does not.

    **Under `tf.distribute`.** The step is assigned in cross-replica
    context, so every replica sees the same value (`MirroredStrategy`,
    `MultiWorkerMirroredStrategy`). Needs `steps_per_execution=1`: the
    callback runs once per batch. Requires the tf_keras flavour
    (`TF_USE_LEGACY_KERAS=1`), like TFMOT itself.

    Example:

    ```python
    import os
    os.environ["TF_USE_LEGACY_KERAS"] = "1"
    import tensorflow_model_optimization as tfmot
    import tf_keras
    from keras_mgpu.callbacks import PruningStepSync
    from keras_mgpu.optimizers import GradientAccumulationOptimizer

    model = tfmot.sparsity.keras.prune_low_magnitude(
        tf_keras.Sequential([tf_keras.layers.Dense(8, input_shape=(4,))]),
        pruning_schedule=tfmot.sparsity.keras.PolynomialDecay(
            0.0, 0.5, begin_step=0, end_step=100  # optimizer updates
        ),
    )
    model.compile(
        GradientAccumulationOptimizer(tf_keras.optimizers.SGD(0.1), 4),
        loss="mse",
    )
    # model.fit(x, y, callbacks=[PruningStepSync()])
    ```
    """

    def __init__(self) -> None:
        require_backend("PruningStepSync", ("tensorflow",))
        if not IS_TF_KERAS:
            raise RuntimeError(
                "PruningStepSync works with TensorFlow Model Optimization, "
                "which needs the tf_keras flavour: set "
                "TF_USE_LEGACY_KERAS=1 before importing keras_mgpu (and "
                "install tf-keras)."
            )
        super().__init__()
        self._wrapper_class = _prune_low_magnitude_class()
        self.prunable_layers: list = []

    def _collect(self) -> list:
        found, seen = [], set()
        for module in [self.model, *self.model.submodules]:
            if isinstance(module, self._wrapper_class) and (
                id(module) not in seen
            ):
                seen.add(id(module))
                found.append(module)
        return found

    def on_train_begin(self, logs: dict | None = None) -> None:
        self.prunable_layers = self._collect()
        if not self.prunable_layers:
            return
        spe = _steps_per_execution(self.model)
        if spe != 1:
            raise ValueError(
                "PruningStepSync sets the pruning step before each batch "
                "and needs `steps_per_execution=1` in `model.compile`. "
                f"Received: steps_per_execution={spe}"
            )

    def on_train_batch_begin(self, batch: int, logs: dict | None = None):
        if not self.prunable_layers:
            return
        # The forward pass adds one, as TFMOT's layer does on every
        # training call: update `u` then runs at pruning step `u + 1`.
        step = tf.cast(
            tf.convert_to_tensor(self.model.optimizer.iterations), tf.int64
        )
        for layer in self.prunable_layers:
            layer.pruning_step.assign(step)

    def on_epoch_end(self, epoch: int, logs: dict | None = None) -> None:
        # Re-mask, so that weights saved after an epoch are mask * weights.
        for layer in self.prunable_layers:
            layer.pruning_obj.weight_mask_op()

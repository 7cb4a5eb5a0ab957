"""`shard_optimizer_state`: the optimizer's state split over the data axis
(ZeRO stage 1, and the accumulated gradients of stage 2 under accumulation).

Keras gives every optimizer variable the layout of the weight it belongs to
(`add_variable_from_reference`), so under `DataParallel`, or along the batch
axis of a `ModelParallel` mesh, each device holds a whole copy of Adam's two
moments, of EMA averages, of `GradientAccumulationOptimizer`'s accumulators.
Those copies are what ZeRO (Rajbhandari et al., 2020) and PyTorch's FSDP
split across the data-parallel devices. Here each optimizer variable gets the
batch axis on one more dimension; the jitted step keeps the state where it
lies (Keras's JAX trainer reads the state's shardings when it builds the
step), and XLA computes each device's slice of the update and gathers the
new weights: the same numbers as unsharded, with 1/N of the state per device.
Weights over the data axis too (ZeRO-3, fully sharded data parallelism):
`plan_layout_map(..., policy="balanced")`, which splits each large weight
along the batch axis as well.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from keras_mgpu._validation import check_int
from keras_mgpu.sharding.plan import (
    DEFAULT_MIN_SHARD_BYTES,
    check_model,
    require_jax,
)


@dataclass
class StateShardingReport:
    """What `shard_optimizer_state` did.

    Attributes:
        axis: the mesh axis the state was split along, and its size.
        sharded: path -> the variable's axes now.
        replicated: path -> why it stays as it was (too small, no dimension
            divisible by the axis size, already split along it).
        bytes_per_device_before / bytes_per_device_after: the optimizer
            state the fullest device holds, measured from its shards.
    """

    axis: str
    axis_size: int
    sharded: dict[str, tuple] = field(default_factory=dict)
    replicated: dict[str, str] = field(default_factory=dict)
    bytes_per_device_before: int = 0
    bytes_per_device_after: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "axis": self.axis,
            "axis_size": self.axis_size,
            "sharded": {k: list(v) for k, v in self.sharded.items()},
            "replicated": dict(self.replicated),
            "bytes_per_device_before": self.bytes_per_device_before,
            "bytes_per_device_after": self.bytes_per_device_after,
        }

    def __str__(self) -> str:
        before = self.bytes_per_device_before / 2**20
        after = self.bytes_per_device_after / 2**20
        return (
            f"optimizer state over {self.axis!r} ({self.axis_size} devices): "
            f"{len(self.sharded)} variables split, "
            f"{len(self.replicated)} kept; per device "
            f"{before:.2f} MiB -> {after:.2f} MiB"
        )


def _bytes_per_device(variables: list) -> int:
    """What the fullest device holds of `variables`."""
    from keras_mgpu.backend.jax.variables import bytes_per_device

    return max(bytes_per_device(variables).values(), default=0)


def _nbytes(variable: Any) -> int:
    import numpy as np

    size = int(np.prod(variable.shape, dtype=np.int64))
    return size * np.dtype(variable.dtype).itemsize


def shard_optimizer_state(
    model: Any,
    *,
    axis: str | None = None,
    min_shard_bytes: int = DEFAULT_MIN_SHARD_BYTES,
) -> StateShardingReport:
    """Split `model`'s optimizer state along the data-parallel mesh axis.

    Call it after `model.compile(...)` under the `keras.distribution` you
    train with (`DataParallel`, or `ModelParallel` with a batch axis), before
    `fit`: the optimizer is built if it is not, and every optimizer
    variable of at least `min_shard_bytes` (Adam's moments, EMA averages,
    `GradientAccumulationOptimizer`'s accumulators, a `LossScaleOptimizer`'s
    inner state) is split along `axis` on its largest dimension that
    divides evenly and is not split already (a `ModelParallel` split along
    the model axis is kept). Training gives the unsharded numbers (XLA
    updates each slice where it lies and gathers the new weights); the
    state per device falls to about 1/N. Checkpoints, `.keras` files and
    `BackupAndRestore` save the whole values and load into the shards.
    The layout is the variables' own: it holds for every later `fit`;
    call it again after a new `compile`.

    JAX only (on TensorFlow a `BackendNotSupportedError`: there
    `tf.distribute` mirrors optimizer state with the variables).

    Args:
        model: a built, compiled Keras model.
        axis: str, the mesh axis to split along; defaults to the
            distribution's batch axis (`batch_dim_name`).
        min_shard_bytes: int >= 0, variables smaller than this (step
            counters, learning rates) stay as they are. Defaults to 4096.

    Returns:
        A `StateShardingReport` (which variables were split, bytes of
        state per device before and after, measured from the shards).

    Example:

    ```python
    import keras, keras_mgpu.sharding
    with keras.distribution.DataParallel().scope():
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(256),
                                  keras.layers.Dense(1)])
        model.compile(keras.optimizers.Adam(), "mse")
        print(keras_mgpu.sharding.shard_optimizer_state(model))
        model.fit(x, y, batch_size=64)
    ```
    """
    import keras

    from keras_mgpu.backend.jax.variables import layout_axes, relayout

    require_jax("shard_optimizer_state")
    check_model(model, "shard_optimizer_state")
    min_shard_bytes = check_int(min_shard_bytes, "min_shard_bytes", minimum=0)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(
            "Argument `model` must be compiled with an optimizer "
            "(`model.compile(optimizer=...)`) before its state can be "
            f"sharded. Received: model={model.name!r} without an optimizer"
        )
    distribution = keras.distribution.distribution()
    if distribution is None:
        raise ValueError(
            "shard_optimizer_state needs the keras.distribution you train "
            "with in force (inside `DataParallel(...).scope()` or after "
            "`keras.distribution.set_distribution(...)`). Received: no "
            "distribution"
        )
    mesh = distribution.device_mesh
    if axis is None:
        axis = getattr(distribution, "batch_dim_name", None)
    if not isinstance(axis, str) or axis not in mesh.axis_names:
        raise ValueError(
            "Argument `axis` must name an axis of the distribution's mesh "
            f"{tuple(mesh.axis_names)}. Received: axis={axis!r}"
        )
    size = dict(zip(mesh.axis_names, mesh.shape))[axis]
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    variables = list(optimizer.variables)
    report = StateShardingReport(axis=axis, axis_size=size)
    report.bytes_per_device_before = _bytes_per_device(variables)
    for variable in variables:
        path = variable.path
        axes = list(layout_axes(variable))
        if size == 1:
            report.replicated[path] = f"axis {axis!r} has one device"
            continue
        if axis in axes:
            report.replicated[path] = f"already split along {axis!r}"
            continue
        if _nbytes(variable) < min_shard_bytes:
            report.replicated[path] = (
                f"{_nbytes(variable)} bytes < min_shard_bytes={min_shard_bytes}"
            )
            continue
        free = sorted(
            (d for d, a in enumerate(axes) if a is None),
            key=lambda d: -variable.shape[d],
        )
        dims = [d for d in free if variable.shape[d] % size == 0]
        if not dims:
            report.replicated[path] = (
                f"no free dimension of shape {tuple(variable.shape)} is "
                f"divisible by {axis}={size}"
            )
            continue
        axes[dims[0]] = axis
        relayout(variable, tuple(axes), mesh)
        report.sharded[path] = tuple(axes)
    report.bytes_per_device_after = _bytes_per_device(variables)
    # Keras's JAX trainer fixes the state's shardings when it makes the
    # train function: a step made before must be made again.
    model.train_function = None
    return report


__all__ = ["StateShardingReport", "shard_optimizer_state"]

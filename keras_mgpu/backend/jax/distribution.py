"""The `keras.distribution` in force, read the way keras_mgpu needs it.

On JAX, `keras.distribution.DataParallel` / `ModelParallel` play the part of
a `tf.distribute` strategy: `distribution.scope()` (or
`keras.distribution.set_distribution`) makes one current, and its device
mesh spans every process's devices after `keras.distribution.initialize()`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def no_distribution() -> Iterator[None]:
    """A context with no `keras.distribution` in force (the one in force
    before is put back on exit, also after an exception)."""
    import keras

    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(previous)


def current_distribution(distribution: Any = None) -> Any:
    """The distribution given, or the one in force (None when there is none,
    or for `keras_mgpu.testing`'s `NoDistribution`, whose mesh is None)."""
    if distribution is not None:
        if getattr(distribution, "device_mesh", True) is None:
            return None
        return distribution
    import keras

    return keras.distribution.distribution()


def data_parallel_size(distribution: Any = None) -> int:
    """How many slices of the global batch one step computes in parallel.

    The size of the mesh axis the batch is split along (`batch_dim_name`):
    every device for `DataParallel`, the data axis of a `ModelParallel` mesh
    (1 when it has none), 1 without a distribution. The mesh spans every
    process's devices, so several hosts are counted.
    """
    distribution = current_distribution(distribution)
    if distribution is None:
        return 1
    mesh = distribution.device_mesh
    batch_dim = getattr(distribution, "batch_dim_name", None)
    if batch_dim is None or batch_dim not in mesh.axis_names:
        return 1
    return int(mesh.shape[list(mesh.axis_names).index(batch_dim)])


def distribution_kind(distribution: Any = None) -> str:
    """ "default" without a distribution; "data_parallel", "model_parallel"
    or "other" for a `keras.distribution.Distribution`."""
    distribution = current_distribution(distribution)
    if distribution is None:
        return "default"
    import keras

    if isinstance(distribution, keras.distribution.DataParallel):
        return "data_parallel"
    if isinstance(distribution, keras.distribution.ModelParallel):
        return "model_parallel"
    return "other"


def process_info() -> dict[str, Any]:
    """This process's place among JAX's processes, as `worker_info` reports
    it on TensorFlow (rank 0 is the chief: it writes files and logs)."""
    import jax

    rank = int(jax.process_index())
    count = int(jax.process_count())
    return {
        "task_type": None if count == 1 else "process",
        "task_id": None if count == 1 else rank,
        "rank": rank,
        "num_workers": count,
        "is_chief": rank == 0,
        "task_name": "local" if count == 1 else f"process:{rank}",
    }

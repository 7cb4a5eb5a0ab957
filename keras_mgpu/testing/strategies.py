"""The strategy matrix a multi-device test runs under, on CPU devices."""

from __future__ import annotations

from typing import Any

STRATEGY_NAMES = (
    "default",
    "one_device",
    "mirrored_2",
    "mirrored_4",
    "central_storage",
)


def mirrored_strategy(
    num_replicas: int = 2, cross_device_ops: Any = None
) -> Any:
    """A `MirroredStrategy` over the first `num_replicas` logical CPUs.

    On CPU, TensorFlow's default `CollectiveAllReduce` pins its group size
    at first use: a 4-replica strategy after a 2-replica one fails in the
    same process ("joining a group with size4, but that group has size
    2"). This factory uses `ReductionToOneDevice` unless told otherwise,
    so strategies of any size can follow each other in one test process.
    Test the default cross-device ops (what users get) in a process of
    their own (`run_workers(..., num_workers=1)` or a subprocess).

    Args:
        num_replicas: int >= 1, replicas (logical CPU devices) to use.
        cross_device_ops: a `tf.distribute.CrossDeviceOps`, or None for
            `ReductionToOneDevice()`.

    Example:

    ```python
    strategy = keras_mgpu.testing.mirrored_strategy(4)
    with strategy.scope():
        model = build_model()
    ```
    """
    import tensorflow as tf

    cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
    if (
        not isinstance(num_replicas, int)
        or isinstance(num_replicas, bool)
        or not 1 <= num_replicas <= len(cpus)
    ):
        raise ValueError(
            f"Argument `num_replicas` must be an integer from 1 to "
            f"{len(cpus)} (the logical CPU devices configured). Received: "
            f"num_replicas={num_replicas!r}"
        )
    return tf.distribute.MirroredStrategy(
        devices=cpus[:num_replicas],
        cross_device_ops=cross_device_ops
        or tf.distribute.ReductionToOneDevice(),
    )


def make_strategy(name: str) -> Any:
    """Build one strategy of `STRATEGY_NAMES` on the logical CPU devices.

    `"default"` (no strategy), `"one_device"`, `"mirrored_2"`,
    `"mirrored_4"` (see `mirrored_strategy`) and `"central_storage"`
    (variables on CPU:0, compute on CPU:0 and CPU:1).
    """
    import tensorflow as tf

    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    if name.startswith("mirrored_") and name[9:].isdigit():
        return mirrored_strategy(int(name[9:]))
    if name == "central_storage":
        cpus = [d.name for d in tf.config.list_logical_devices("CPU")]
        return tf.distribute.experimental.CentralStorageStrategy(
            compute_devices=cpus[:2], parameter_device=cpus[0]
        )
    raise ValueError(
        f"Argument `name` must be one of {', '.join(STRATEGY_NAMES)} (or "
        f"mirrored_<n>). Received: name={name!r}"
    )

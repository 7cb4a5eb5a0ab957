"""Logical CPU devices for tests, configured before TensorFlow starts."""

from __future__ import annotations

DEFAULT_CPU_DEVICES = 4


def configure_cpu_devices(count: int = DEFAULT_CPU_DEVICES) -> list[str]:
    """Split the host CPU into `count` logical devices; return their names.

    Must run before TensorFlow initialises its runtime (before any tensor,
    strategy or model is built). Calling it again with the same `count` is
    a no-op; with another count, or after TensorFlow started with a
    different device layout, it raises a `RuntimeError` that says so.

    Args:
        count: int >= 1, logical CPU devices. Defaults to 4.

    Returns:
        The logical device names, e.g. `["/device:CPU:0", ...]`.

    Example:

    ```python
    from keras_mgpu.testing import configure_cpu_devices

    configure_cpu_devices(4)  # first thing in conftest.py
    ```
    """
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(
            "Argument `count` must be an integer >= 1. "
            f"Received: count={count!r}"
        )
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    existing = tf.config.get_logical_device_configuration(cpu)
    if existing is not None and len(existing) == count:
        return _names()
    try:
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * count
        )
    except RuntimeError as exc:
        have = len(tf.config.list_logical_devices("CPU"))
        raise RuntimeError(
            f"keras_mgpu.testing could not split the CPU into {count} "
            f"logical devices: TensorFlow's runtime is already initialised "
            f"with {have}. Something built a tensor, strategy or model "
            "before the plugin ran (a conftest.py or a test module at "
            "import). Activate the plugin on the command line "
            "(`pytest -p keras_mgpu.testing`) or in the ini file "
            "(`keras_mgpu_cpu_devices = 4`), and build TensorFlow objects "
            "inside fixtures or tests."
        ) from exc
    return _names()


def _names() -> list[str]:
    import tensorflow as tf

    return [d.name for d in tf.config.list_logical_devices("CPU")]

"""CPU devices for tests, configured before the backend's runtime starts.

TensorFlow: logical CPU devices (`tf.config.set_logical_device_configuration`,
which records the split without starting the runtime). JAX:
`--xla_force_host_platform_device_count=N` in `XLA_FLAGS`, read when JAX
first creates its CPU client (as Keras's own CI does).
"""

from __future__ import annotations

from keras_mgpu_pytest import (
    DEFAULT_CPU_DEVICES,
    jax_started,
    requested_backend,
    set_xla_device_count,
    split_tensorflow_cpu,
    split_when_tensorflow_imported,
)

__all__ = [
    "DEFAULT_CPU_DEVICES",
    "configure_cpu_devices",
    "configured_devices",
    "device_names",
    "requested_backend",
]


def configure_cpu_devices(count: int = DEFAULT_CPU_DEVICES) -> list[str]:
    """Split the host CPU into `count` devices; return their names.

    TensorFlow: records `count` logical CPU devices without starting the
    runtime, so TensorFlow options that must precede it (threads, GPU
    memory growth) can still be set afterwards. It must run before the
    runtime starts (before any tensor, strategy or model is built, or
    `tf.config.list_logical_devices`); with the runtime started on another
    number of devices it raises a `RuntimeError` that says so. The names
    returned are those the runtime will have (`"/device:CPU:0"`, ...).

    JAX: sets `--xla_force_host_platform_device_count` in `XLA_FLAGS` when
    JAX has not started, then returns `jax.devices("cpu")` (starting JAX);
    a `RuntimeError` when JAX started with another number of devices.

    Calling it again with the same `count` is a no-op.

    Args:
        count: int >= 1, CPU devices. Defaults to 4.

    Returns:
        The device names, e.g. `["/device:CPU:0", ...]` on TensorFlow.

    Example:

    ```python
    from keras_mgpu.testing import configure_cpu_devices

    configure_cpu_devices(4)  # first thing in conftest.py
    ```
    """
    _check_count(count)
    if requested_backend() == "jax":
        return _configure_jax_cpu_devices(count)
    if split_tensorflow_cpu(count):
        return device_names()
    return [f"/device:CPU:{i}" for i in range(count)]


def configured_devices(count: int) -> int:
    """What the pytest plugin runs after the conftest.py files: split the
    CPU into `count` devices without starting any runtime (on TensorFlow
    when it is imported, now if it is), or check the split of a runtime a
    conftest.py started. Returns `count`.

    Raises:
        RuntimeError: the runtime started with another number of devices.
    """
    _check_count(count)
    if requested_backend() != "jax":
        split_when_tensorflow_imported(count)
    elif not set_xla_device_count(count):  # JAX started: check it
        _configure_jax_cpu_devices(count)
    return count


def device_names() -> list[str]:
    """The CPU device names of this process's backend (starts its
    runtime): logical CPU devices on TensorFlow, `jax.devices("cpu")`."""
    if requested_backend() == "jax":
        import jax

        return [str(d) for d in jax.devices("cpu")]
    return [d.name for d in _tensorflow().config.list_logical_devices("CPU")]


def _check_count(count: int) -> None:
    if not isinstance(count, int) or isinstance(count, bool) or count < 1:
        raise ValueError(
            "Argument `count` must be an integer >= 1. "
            f"Received: count={count!r}"
        )


def _tensorflow():
    import tensorflow as tf

    return tf


def _configure_jax_cpu_devices(count: int) -> list[str]:
    set_xla_device_count(count)
    import jax

    devices = jax.devices("cpu")
    if len(devices) != count:
        raise RuntimeError(
            f"keras_mgpu.testing could not split the CPU into {count} JAX "
            f"devices: JAX has already started with {len(devices)}. "
            "Something ran JAX before the plugin (a conftest.py or a test "
            "module at import). Activate the plugin on the command line "
            "(`pytest -p keras_mgpu.testing`) or in the ini file "
            f"(`keras_mgpu_cpu_devices = {count}`), or set "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={count} "
            "before JAX starts."
        )
    return [str(d) for d in devices]


_jax_started = jax_started  # the name keras_mgpu.demo used

"""CPU devices for tests, configured before the backend's runtime starts.

TensorFlow: logical CPU devices (`tf.config.set_logical_device_configuration`).
JAX: `--xla_force_host_platform_device_count=N` in `XLA_FLAGS`, read when JAX
first creates its CPU client (as Keras's own CI does).
"""

from __future__ import annotations

import json
import os
import re
import sys

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
    if requested_backend() == "jax":
        return _configure_jax_cpu_devices(count)
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


def requested_backend(environ: dict | None = None) -> str:
    """The Keras backend this process will run, read without importing Keras:
    `KERAS_BACKEND`, else `backend` in `$KERAS_HOME/keras.json`, else
    "tensorflow" (what keras_mgpu picks when nothing is set)."""
    environ = os.environ if environ is None else environ
    if environ.get("KERAS_BACKEND"):
        return environ["KERAS_BACKEND"]
    home = environ.get(
        "KERAS_HOME", os.path.join(os.path.expanduser("~"), ".keras")
    )
    try:
        with open(os.path.join(home, "keras.json")) as f:
            return str(json.load(f).get("backend") or "tensorflow")
    except (OSError, ValueError):
        return "tensorflow"


_XLA_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def _jax_started() -> bool:
    """Whether JAX created its backends already (XLA_FLAGS are read then)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - JAX moved it
        return True
    return bool(getattr(xla_bridge, "_backends", None))


def _configure_jax_cpu_devices(count: int) -> list[str]:
    if not _jax_started():
        flags = re.sub(
            rf"{_XLA_DEVICE_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", "")
        ).strip()
        os.environ["XLA_FLAGS"] = f"{flags} {_XLA_DEVICE_FLAG}={count}".strip()
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
            f"XLA_FLAGS={_XLA_DEVICE_FLAG}={count} before JAX starts."
        )
    return [str(d) for d in devices]

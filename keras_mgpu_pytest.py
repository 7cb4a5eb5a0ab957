"""The `pytest11` entry point of keras_mgpu: registers the options of
`keras_mgpu.testing` and activates it only when asked.

Kept outside the `keras_mgpu` package so that pytest loading it imports
neither keras_mgpu (which fixes the Keras flavour at import) nor
TensorFlow: installing keras_mgpu changes no one's other tests.
`pytest -p keras_mgpu.testing` activates the plugin directly; setting the
ini option `keras_mgpu_cpu_devices` (or `--keras-mgpu-cpu-devices`)
activates it from here.

When asked, the work is split around the user's `conftest.py` files:

- before them, only what must precede them and starts nothing: the device
  count is read (a bad value is a usage error); on JAX, `XLA_FLAGS` gets
  `--xla_force_host_platform_device_count` (JAX reads it when it starts,
  possibly in a conftest.py); on TensorFlow, an import hook records the
  logical CPU devices right after `import tensorflow` completes, wherever
  that happens (recording them starts no runtime). Neither keras_mgpu,
  Keras nor TensorFlow is imported, so a conftest.py still chooses the
  Keras flavour (`TF_USE_LEGACY_KERAS`) and TensorFlow's runtime options
  (threads, GPU memory growth), and may build tensors at import;
- after them (`pytest_configure`), `keras_mgpu.testing` is registered (which
  imports keras_mgpu) and checks the split if TensorFlow was imported;
  the first test or fixture that runs TensorFlow starts its runtime.

`keras_mgpu.testing.devices` shares the helpers below; they work without
pytest installed.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
import sys
from typing import Any

try:
    import pytest
except ImportError:  # keras_mgpu.testing's helpers use this module too
    pytest = None  # type: ignore[assignment]

_PLUGIN = "keras_mgpu.testing"
INI_OPTION = "keras_mgpu_cpu_devices"
CLI_OPTION = "--keras-mgpu-cpu-devices"
DEFAULT_CPU_DEVICES = 4
_XLA_DEVICE_FLAG = "--xla_force_host_platform_device_count"


def add_options(parser: Any) -> None:
    """The plugin's ini and command-line options (registered here, so they
    exist before activation, and by `keras_mgpu.testing` under `-p`)."""
    parser.addini(
        INI_OPTION,
        "keras_mgpu.testing: logical CPU devices to split the host into "
        "(setting it activates the plugin)",
        default="",
    )
    try:
        parser.addoption(
            CLI_OPTION,
            default=None,
            metavar="N",
            help="keras_mgpu.testing: logical CPU devices (activates it; "
            f"default {DEFAULT_CPU_DEVICES})",
        )
    except ValueError:  # already added by the other module
        pass


def asked(config: Any) -> bool:
    """Whether the ini option or the command line asks for the plugin."""
    return config.getoption(CLI_OPTION, default=None) is not None or bool(
        str(config.getini(INI_OPTION) or "").strip()
    )


def cpu_device_count(config: Any) -> int:
    """Devices asked for: the command line, else the ini file, else 4.

    Raises:
        pytest.UsageError: not a whole number >= 1 (the message names the
            option, the value and what is allowed).
    """
    given = config.getoption(CLI_OPTION, default=None)
    source = CLI_OPTION
    if given is None:
        given = str(config.getini(INI_OPTION) or "").strip()
        source = INI_OPTION
        if not given:
            return DEFAULT_CPU_DEVICES
    text = str(given).strip()
    if not re.fullmatch(r"[0-9]+", text) or int(text) < 1:
        raise pytest.UsageError(
            f"keras_mgpu.testing: {source} must be a whole number >= 1 (the "
            f"CPU devices to split the host into, e.g. {INI_OPTION} = 4). "
            f"Received: {source}={given!r}"
        )
    return int(text)


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


def jax_started() -> bool:
    """Whether JAX created its backends already (XLA_FLAGS are read then)."""
    if "jax" not in sys.modules:
        return False
    try:
        from jax._src import xla_bridge
    except ImportError:  # pragma: no cover - JAX moved it
        return True
    return bool(getattr(xla_bridge, "_backends", None))


def set_xla_device_count(count: int) -> bool:
    """Put `--xla_force_host_platform_device_count=count` in `XLA_FLAGS`
    unless JAX started already (then it returns False)."""
    if jax_started():
        return False
    flags = re.sub(
        rf"{_XLA_DEVICE_FLAG}=\S+", "", os.environ.get("XLA_FLAGS", "")
    ).strip()
    os.environ["XLA_FLAGS"] = f"{flags} {_XLA_DEVICE_FLAG}={count}".strip()
    return True


def split_tensorflow_cpu(count: int) -> bool:
    """Record `count` logical CPU devices in TensorFlow (importing it),
    without starting its runtime. True when the runtime had started
    already with `count` devices, False when it has not started.

    Raises:
        RuntimeError: the runtime started with another number of devices.
    """
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    existing = tf.config.get_logical_device_configuration(cpu)
    if existing is None or len(existing) != count:
        existing = [tf.config.LogicalDeviceConfiguration()] * count
    try:
        # Records the split; raises once the runtime has started.
        tf.config.set_logical_device_configuration(cpu, existing)
        return False
    except RuntimeError as exc:
        # The runtime started already: listing its devices starts nothing.
        have = len(tf.config.list_logical_devices("CPU"))
        if have == count:
            return True
        raise RuntimeError(
            f"keras_mgpu.testing could not split the CPU into {count} "
            f"logical devices: TensorFlow's runtime is already initialised "
            f"with {have}. Something started it before the devices were "
            "configured (a pytest plugin, a conftest.py or a test module "
            "that built a tensor, strategy or model at import). Call "
            f"keras_mgpu.testing.configure_cpu_devices({count}) before it, "
            "or build TensorFlow objects inside fixtures or tests."
        ) from exc


class _SplitOnImport:
    """A `sys.meta_path` finder that lets `tensorflow` import as usual and
    then records the logical CPU devices, before the importer's next line:
    the split needs no runtime, and whatever the importer does next
    (threads, GPU memory growth, building tensors) sees it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._finding = False

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname != "tensorflow" or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module
        count = self.count

        def exec_then_split(module: Any) -> None:
            exec_module(module)
            split_tensorflow_cpu(count)

        spec.loader.exec_module = exec_then_split  # this import's loader
        remove_tensorflow_hook()
        return spec


def split_when_tensorflow_imported(count: int) -> None:
    """Split TensorFlow's CPU into `count` logical devices when it is
    imported, or now when it is imported already."""
    remove_tensorflow_hook()
    if "tensorflow" in sys.modules:
        split_tensorflow_cpu(count)
    else:
        sys.meta_path.insert(0, _SplitOnImport(count))


def remove_tensorflow_hook() -> None:
    sys.meta_path[:] = [
        f for f in sys.meta_path if not isinstance(f, _SplitOnImport)
    ]


def before_conftests(config: Any) -> None:
    """The part that must precede the conftest.py files. It imports and
    starts nothing: on JAX it sets `XLA_FLAGS`; on TensorFlow it arranges
    for the CPU to be split when (and if) something imports TensorFlow."""
    config._keras_mgpu_count = count = cpu_device_count(config)
    if requested_backend() == "jax":
        set_xla_device_count(count)
    elif "tensorflow" not in sys.modules:
        split_when_tensorflow_imported(count)


def pytest_addoption(parser: Any) -> None:
    add_options(parser)


def _tryfirst(hook: Any) -> Any:
    return pytest.hookimpl(tryfirst=True)(hook) if pytest else hook


@_tryfirst
def pytest_load_initial_conftests(early_config: Any) -> None:
    if early_config.pluginmanager.has_plugin(_PLUGIN):
        return  # `-p keras_mgpu.testing`: the plugin does it itself
    if asked(early_config):
        before_conftests(early_config)


def pytest_configure(config: Any) -> None:
    # After the initial conftest.py files: they chose the Keras flavour and
    # TensorFlow's options; registering the plugin now imports keras_mgpu
    # (its `pytest_configure` runs at registration).
    manager = config.pluginmanager
    if asked(config) and not manager.has_plugin(_PLUGIN):
        # A library module, not marked for assertion rewriting (a
        # conftest.py may have imported it already).
        manager.register(importlib.import_module(_PLUGIN), _PLUGIN)

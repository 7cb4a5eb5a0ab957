"""The `pytest11` entry point of keras_mgpu: registers the options of
`keras_mgpu.testing` and activates it only when asked.

Kept outside the `keras_mgpu` package so that pytest loading it imports
neither keras_mgpu (which fixes the Keras flavour at import) nor
TensorFlow: installing keras_mgpu changes no one's other tests.
`pytest -p keras_mgpu.testing` activates the plugin directly; setting the
ini option `keras_mgpu_cpu_devices` (or `--keras-mgpu-cpu-devices`)
activates it from here.
"""

from __future__ import annotations

from typing import Any

import pytest

_PLUGIN = "keras_mgpu.testing"


def pytest_addoption(parser: Any) -> None:
    parser.addini(
        "keras_mgpu_cpu_devices",
        "keras_mgpu.testing: logical CPU devices to split the host into "
        "(setting it activates the plugin)",
        default="",
    )
    try:
        parser.addoption(
            "--keras-mgpu-cpu-devices",
            type=int,
            default=None,
            metavar="N",
            help="keras_mgpu.testing: logical CPU devices (activates it)",
        )
    except ValueError:  # `-p keras_mgpu.testing` registered it first
        pass


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: Any) -> None:
    manager = early_config.pluginmanager
    if manager.has_plugin(_PLUGIN):
        return  # `-p keras_mgpu.testing`: the plugin configures itself
    asked = early_config.getoption("--keras-mgpu-cpu-devices", default=None)
    if (
        asked is None
        and not str(early_config.getini("keras_mgpu_cpu_devices") or "").strip()
    ):
        return  # not asked: leave TensorFlow alone
    manager.import_plugin(_PLUGIN)
    manager.get_plugin(_PLUGIN).activate(early_config)

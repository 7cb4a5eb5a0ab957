"""keras_mgpu.testing without a pytest process: the option parsing of the
plugin, and the helpers where pytest is not installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import keras_mgpu_pytest


class _Config:
    def __init__(self, ini: str = "", cli: str | None = None) -> None:
        self.ini, self.cli = ini, cli

    def getoption(self, name, default=None):
        return self.cli

    def getini(self, name):
        return self.ini


def test_the_device_count_and_bad_values_name_option_and_value():
    for ini, cli, expected in [
        ("", None, 4),
        ("2", None, 2),
        (" 3 ", None, 3),
        ("2", "5", 5),
    ]:
        assert keras_mgpu_pytest.cpu_device_count(_Config(ini, cli)) == expected
    for ini, cli, match in [
        ("four", None, r"keras_mgpu_cpu_devices must be a whole number >= 1"),
        ("0", None, r"Received: keras_mgpu_cpu_devices='0'"),
        ("2.5", None, r"Received: keras_mgpu_cpu_devices='2.5'"),
        ("4", "-1", r"Received: --keras-mgpu-cpu-devices='-1'"),
    ]:
        with pytest.raises(pytest.UsageError, match=match):
            keras_mgpu_pytest.cpu_device_count(_Config(ini, cli))


_WITHOUT_PYTEST = """
import sys

class HidePytest:
    def find_spec(self, name, path=None, target=None):
        if name in ("pytest", "_pytest") or name.startswith("_pytest."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, HidePytest())
import keras_mgpu.testing as testing
from keras_mgpu.testing import (
    assert_trains_like, configure_cpu_devices, make_strategy,
    run_workers, set_random_seed,
)
assert "pytest" not in sys.modules and "_pytest" not in sys.modules
assert not hasattr(testing, "strategy")  # no fixtures without pytest
print("IMPORTED", "tensorflow" in sys.modules)
"""


def test_the_helpers_import_without_pytest():
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT_PYTEST],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "KERAS_BACKEND": "jax"},
    )
    assert result.returncode == 0, result.stderr
    assert "IMPORTED False" in result.stdout

"""The pytest side of `keras_mgpu.testing`: hooks and fixtures.

`keras_mgpu.testing` re-exports these names when pytest is installed, so
`pytest -p keras_mgpu.testing` (or the ini option, through the
`keras_mgpu_pytest` entry point) registers them; the helpers of
`keras_mgpu.testing` work without pytest.

Nothing here starts a backend's runtime, and nothing imports keras_mgpu
before the user's `conftest.py` files ran (under `-p keras_mgpu.testing`,
where pytest imports it first, the flavour is read again after them): see
`keras_mgpu_pytest` for what runs before them (the device count, JAX's
`XLA_FLAGS`, a hook that splits TensorFlow's CPU when it is imported).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

import keras_mgpu_pytest
from keras_mgpu.testing.devices import (
    configured_devices,
    device_names,
    requested_backend,
)
from keras_mgpu.testing.strategies import (
    STRATEGY_NAMES,
    make_strategy,
    mirrored_strategy,
)
from keras_mgpu.testing.workers import run_workers

INI_OPTION = keras_mgpu_pytest.INI_OPTION
add_options = keras_mgpu_pytest.add_options
cpu_device_count = keras_mgpu_pytest.cpu_device_count

_FLAVOUR_VARIABLE = "TF_USE_LEGACY_KERAS"


def pytest_addoption(parser: Any) -> None:
    add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: Any) -> None:
    # Called only when the plugin is registered before the conftest.py
    # files (`-p keras_mgpu.testing`): pytest imported keras_mgpu to load
    # it, so the flavour keras_mgpu read is re-read after them.
    keras_mgpu_pytest.before_conftests(early_config)
    early_config._keras_mgpu_flavour_env = os.environ.get(_FLAVOUR_VARIABLE)


def activate(config: Any) -> None:
    """Split the CPU after the conftest.py files (idempotent); starts no
    runtime."""
    if getattr(config, "_keras_mgpu_devices", None) is not None:
        return
    if getattr(config, "_keras_mgpu_count", None) is None:
        keras_mgpu_pytest.before_conftests(config)  # registered late
    _reread_flavour(config)
    try:
        config._keras_mgpu_devices = configured_devices(
            config._keras_mgpu_count
        )
    except RuntimeError as exc:
        raise pytest.UsageError(str(exc)) from None


def _reread_flavour(config: Any) -> None:
    """Under `-p keras_mgpu.testing`, pytest's import of the plugin made
    keras_mgpu read `TF_USE_LEGACY_KERAS` before any conftest.py ran. If no
    keras_mgpu component has been built since (so nothing depends on the
    flavour yet) and a conftest.py changed the variable, read it again."""
    if not hasattr(config, "_keras_mgpu_flavour_env"):
        return  # loaded after the conftest.py files: nothing to re-read
    if os.environ.get(_FLAVOUR_VARIABLE) == config._keras_mgpu_flavour_env:
        return
    if "keras_mgpu._flavour" in sys.modules:
        return  # a conftest.py built on the flavour already
    from keras_mgpu import _flavour_switch

    _flavour_switch.LEGACY_REQUESTED_AT_IMPORT = (
        _flavour_switch.legacy_keras_requested()
    )


def pytest_configure(config: Any) -> None:
    activate(config)


def pytest_sessionfinish(session: Any) -> None:
    from keras_mgpu.testing.workers import kill_all

    kill_all()


def pytest_report_header(config: Any) -> str:
    count = getattr(config, "_keras_mgpu_devices", None) or 0
    kind = "JAX CPU" if requested_backend() == "jax" else "logical CPU"
    return f"keras_mgpu.testing: {count} {kind} devices"


# ----------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------
@pytest.fixture(scope="session")
def cpu_devices() -> list[str]:
    """The CPU device names the plugin configured (starts the runtime)."""
    return device_names()


@pytest.fixture(params=STRATEGY_NAMES)
def strategy(request: Any) -> Any:
    """Each entry of the running backend's matrix (test ids:
    `[mirrored_2]`, `[data_parallel_2]`, ...), not entered: use
    `with strategy.scope():`. Entries needing more devices than configured
    are skipped, with the reason."""
    from keras_mgpu.testing.strategies import (
        available_devices,
        devices_needed,
    )

    needed, have = devices_needed(request.param), available_devices()
    if needed > have:
        pytest.skip(
            f"{request.param} needs {needed} CPU devices; {have} configured "
            f"({INI_OPTION} = {have})"
        )
    return make_strategy(request.param)


@pytest.fixture
def strategy_name(strategy: Any, request: Any) -> str:
    """The matrix name of the `strategy` in use."""
    return request.node.callspec.params["strategy"]


@pytest.fixture(name="mirrored_strategy")
def mirrored_strategy_factory() -> Any:
    """`mirrored_strategy(n)`: a MirroredStrategy of n replicas
    (TensorFlow; on JAX it refuses, naming `DataParallel`)."""
    from keras_mgpu.testing.strategies import running_backend

    if running_backend() == "jax":
        mirrored_strategy()  # raises BackendNotSupportedError, says why
    return mirrored_strategy


@pytest.fixture(name="run_workers")
def run_workers_fixture() -> Any:
    """`run_workers(fn, num_workers=2, *args, timeout=..., chief=False)`:
    a TensorFlow multi-worker cluster, or on JAX a `jax.distributed` one
    (`chief=True` refused there)."""
    return run_workers


__all__ = [
    "activate",
    "cpu_devices",
    "mirrored_strategy_factory",
    "pytest_addoption",
    "pytest_configure",
    "pytest_load_initial_conftests",
    "pytest_report_header",
    "pytest_sessionfinish",
    "run_workers_fixture",
    "strategy",
    "strategy_name",
]

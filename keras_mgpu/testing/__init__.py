"""keras_mgpu.testing: test multi-device Keras code on a laptop's CPU.

A pytest plugin, inactive until asked. Activate it with
`pytest -p keras_mgpu.testing` (4 logical CPU devices), or in the ini file:

```ini
[pytest]
keras_mgpu_cpu_devices = 4
```

(`--keras-mgpu-cpu-devices N` on the command line sets the number too).
Installing keras_mgpu changes no one's other tests: without activation,
TensorFlow is not imported by the plugin and sees one CPU device.

Once active, the host CPU is split into devices before the backend's
runtime starts (TensorFlow: logical CPU devices; JAX: `XLA_FLAGS`
`--xla_force_host_platform_device_count`; a clear error if something started
it first), and these fixtures exist:

- `strategy`: parametrised over the matrix of the running backend (ids in
  the test names: `test_x[mirrored_2]`); `strategy_name` gives the id.
  TensorFlow: `default`, `one_device`, `mirrored_2`, `mirrored_4`,
  `central_storage`. JAX (`KERAS_BACKEND=jax`): `default` (no
  distribution), `data_parallel_1`, `data_parallel_2`, `data_parallel_4`
  (`keras.distribution.DataParallel`) and `model_parallel_2x2`
  (`ModelParallel` on a ("batch", "model") mesh whose `LayoutMap` splits
  Dense kernels and biases along "model"). The fixture returns the
  strategy or distribution without entering it: both kinds have a
  `.scope()`, so one test body runs on either backend:

  ```python
  def test_trains(strategy):
      with strategy.scope():  # tf.distribute or keras.distribution
          model = build_model()
          model.fit(x, y, batch_size=16)
  ```

  On JAX, `fit` belongs inside the scope too (Keras reads the distribution
  in force to split the batch). An entry that needs more devices than
  configured is skipped, with the reason.
- `mirrored_strategy`: a factory, `mirrored_strategy(n)`, for a
  `MirroredStrategy` of n replicas that any other size may follow in the
  same process (it avoids `CollectiveAllReduce` pinning its group size).
  TensorFlow only; on JAX it refuses, naming `DataParallel`.
- `run_workers`: `run_workers(fn, num_workers=2, *args, timeout=...)` runs
  an importable function in real processes forming a multi-worker cluster
  on 127.0.0.1 (`chief=True` for a chief + workers cluster), returns their
  results, shows their output when one fails and kills the whole process
  group on time-out or failure. On JAX (`KERAS_BACKEND=jax`) the processes
  form a `jax.distributed` cluster (gloo CPU collectives) instead.
- `cpu_devices`: the device names.

The same helpers are plain functions here (`run_workers`,
`assert_trains_like`, `mirrored_strategy`, `make_strategy`,
`configure_cpu_devices`) for use outside fixtures, with `set_random_seed`
(Keras's, without importing TensorFlow on JAX). Works with Keras 3
(TensorFlow or JAX backend) and tf_keras (the flavour the test process runs)
and with pytest-xdist (each xdist process configures its own devices).
"""

from __future__ import annotations

from typing import Any

from keras_mgpu.testing.devices import (
    DEFAULT_CPU_DEVICES,
    configure_cpu_devices,
)
from keras_mgpu.testing.numerics import assert_trains_like
from keras_mgpu.testing.seeds import set_random_seed
from keras_mgpu.testing.strategies import (
    JAX_STRATEGY_NAMES,
    STRATEGY_NAMES,
    TF_STRATEGY_NAMES,
    make_strategy,
    mirrored_strategy,
)
from keras_mgpu.testing.workers import WorkersFailed, run_workers

__all__ = [
    "DEFAULT_CPU_DEVICES",
    "JAX_STRATEGY_NAMES",
    "STRATEGY_NAMES",
    "TF_STRATEGY_NAMES",
    "WorkersFailed",
    "assert_trains_like",
    "configure_cpu_devices",
    "make_strategy",
    "mirrored_strategy",
    "run_workers",
    "set_random_seed",
]

import pytest  # noqa: E402  (the plugin needs it; the helpers do not)

INI_OPTION = "keras_mgpu_cpu_devices"


def add_options(parser: Any) -> None:
    """The plugin's ini and command-line options (also registered by the
    `keras_mgpu_pytest` entry point, so they exist before activation)."""
    parser.addini(
        INI_OPTION,
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
            help="keras_mgpu.testing: logical CPU devices (default 4)",
        )
    except ValueError:  # already added by the entry point
        pass


def cpu_device_count(config: Any) -> int:
    """Devices asked for: the command line, else the ini file, else 4."""
    given = config.getoption("--keras-mgpu-cpu-devices", default=None)
    if given is None:
        text = str(config.getini(INI_OPTION) or "").strip()
        given = int(text) if text else DEFAULT_CPU_DEVICES
    if given < 1:
        raise pytest.UsageError(
            f"{INI_OPTION} / --keras-mgpu-cpu-devices must be >= 1. "
            f"Received: {given}"
        )
    return given


def pytest_addoption(parser: Any) -> None:
    add_options(parser)


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: Any) -> None:
    # Before any conftest.py runs: the devices must exist before
    # TensorFlow's runtime starts.
    activate(early_config)


def activate(config: Any) -> None:
    """Configure the devices once per process (idempotent)."""
    if getattr(config, "_keras_mgpu_devices", None) is not None:
        return
    try:
        config._keras_mgpu_devices = configure_cpu_devices(
            cpu_device_count(config)
        )
    except RuntimeError as exc:
        raise pytest.UsageError(str(exc)) from None


def pytest_configure(config: Any) -> None:
    activate(config)  # when activated after the initial conftests


def pytest_sessionfinish(session: Any) -> None:
    from keras_mgpu.testing.workers import kill_all

    kill_all()


def pytest_report_header(config: Any) -> str:
    from keras_mgpu.testing.devices import requested_backend

    devices = getattr(config, "_keras_mgpu_devices", None) or []
    kind = "JAX CPU" if requested_backend() == "jax" else "logical CPU"
    return f"keras_mgpu.testing: {len(devices)} {kind} devices"


# ----------------------------------------------------------------------
# Fixtures
# ----------------------------------------------------------------------
@pytest.fixture(scope="session")
def cpu_devices(pytestconfig: Any) -> list[str]:
    """The logical CPU device names the plugin configured."""
    return list(pytestconfig._keras_mgpu_devices)


@pytest.fixture(params=STRATEGY_NAMES)
def strategy(request: Any) -> Any:
    """Each entry of the running backend's matrix (test ids:
    `[mirrored_2]`, `[data_parallel_2]`, ...), not entered: use
    `with strategy.scope():`. Entries needing more devices than configured
    are skipped."""
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
    """`run_workers(fn, num_workers=2, *args, timeout=..., chief=False)`
    (TensorFlow; on JAX it refuses)."""
    from keras_mgpu.testing.workers import _refuse_off_tensorflow

    _refuse_off_tensorflow()
    return run_workers

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
runtime starts, without starting it and without importing keras_mgpu
before your `conftest.py` files ran, so they can still choose the Keras
flavour (`TF_USE_LEGACY_KERAS`) and the runtime's options (threads, GPU
memory growth, `jax_num_cpu_devices`). TensorFlow: logical CPU devices,
recorded right after TensorFlow is imported (a conftest.py may build
tensors at import). JAX: `XLA_FLAGS` `--xla_force_host_platform_device_count`,
set before the conftest.py files. A clear error if something started the
runtime first with another number of devices. These fixtures exist:

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
(Keras's, without importing TensorFlow on JAX). The helpers need no
pytest: `import keras_mgpu.testing` works where pytest is not installed
(the plugin's hooks and fixtures live in `keras_mgpu.testing.plugin`).
Works with Keras 3 (TensorFlow or JAX backend) and tf_keras (the flavour
the test process runs) and with pytest-xdist (each xdist process
configures its own devices).
"""

from __future__ import annotations

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

# The pytest plugin (hooks and fixtures), when pytest is installed: the
# helpers above work without it (pytest is not a dependency of keras_mgpu).
try:
    import pytest as _pytest  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    pass
else:
    from keras_mgpu.testing.plugin import (  # noqa: E402, F401
        activate,
        cpu_devices,
        mirrored_strategy_factory,
        pytest_addoption,
        pytest_configure,
        pytest_load_initial_conftests,
        pytest_report_header,
        pytest_sessionfinish,
        run_workers_fixture,
        strategy,
        strategy_name,
    )

"""Shared test harness: the flavour, seeds, and keras_mgpu.testing.

The 4 logical CPU devices and the strategy matrix come from our own pytest
plugin, `keras_mgpu.testing` (activated by `keras_mgpu_cpu_devices` in
pyproject.toml), which configures the devices before this file runs.
Strategies are built inside fixtures, never at collection time.

Mirrored strategies here use `ReductionToOneDevice`: on CPU the default
`CollectiveAllReduce` pins its collective group size at first use, so a
4-replica strategy after a 2-replica one fails in the same process
(keras-facts.md). The default cross-device ops, which users get, are covered
by tests that run in a process of their own (`tests/_processes.py`).
"""

from __future__ import annotations

import gc
import os
import re
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("PYTHONHASHSEED", "0")

import pytest  # noqa: E402

# Each backend runs in pytest processes of its own (tests/run_suite.py). A
# test is written once: a module that declares
# `pytestmark = pytest.mark.backends("tensorflow", "jax")` is collected by
# both backends' jobs, and a test in it marked `@pytest.mark.backends("jax")`
# (or "tensorflow") runs in that job only. Without the declaration a module
# is one backend's: `test_*_jax.py` JAX's, the others TensorFlow's (and
# tf_keras's, under tests/legacy).
BACKEND = os.environ["KERAS_BACKEND"]
NUM_LOGICAL_CPUS = 4

if BACKEND == "jax":
    import jax  # noqa: E402

    # The 4 CPU devices come from keras_mgpu.testing (XLA_FLAGS set before
    # JAX starts), activated by `keras_mgpu_cpu_devices = 4`.
    if len(jax.devices("cpu")) != NUM_LOGICAL_CPUS:
        raise RuntimeError(
            "tests/ need keras_mgpu.testing's 4 CPU devices: install "
            "keras_mgpu (pip install -e .) so its pytest plugin is registered."
        )
else:
    import tensorflow as tf  # noqa: E402

    # The 4 logical CPU devices come from keras_mgpu.testing, activated by
    # `keras_mgpu_cpu_devices = 4` in pyproject.toml (before this file runs).
    if len(tf.config.list_logical_devices("CPU")) != NUM_LOGICAL_CPUS:
        raise RuntimeError(
            "tests/ need keras_mgpu.testing's 4 logical CPU devices: install "
            "keras_mgpu (pip install -e .) so its pytest plugin is "
            "registered."
        )


BACKENDS = ("tensorflow", "jax")
_MODULE_BACKENDS = re.compile(
    r"^pytestmark\s*=.*?mark\.backends\(([^)]*)\)", re.MULTILINE | re.DOTALL
)


def module_backends(path) -> tuple:
    """The backends whose jobs collect the test module at `path`: those its
    module-level `pytestmark = pytest.mark.backends(...)` names (read from
    the source, so the other backend's job never imports it), else JAX for
    `test_*_jax.py` and TensorFlow for the others."""
    with open(path, encoding="utf-8") as f:
        match = _MODULE_BACKENDS.search(f.read())
    if match is not None:
        named = tuple(re.findall(r"[\"'](\w+)[\"']", match.group(1)))
        unknown = set(named) - set(BACKENDS)
        if not named or unknown:
            raise ValueError(
                f"{path}: pytest.mark.backends names {named!r}; allowed: "
                f"one or more of {BACKENDS}."
            )
        return named
    return ("jax",) if str(path).endswith("_jax.py") else ("tensorflow",)


def pytest_ignore_collect(collection_path, config):
    """One backend's test modules per process (see `module_backends`)."""
    name = collection_path.name
    if not (name.startswith("test_") and name.endswith(".py")):
        return None
    if BACKEND not in module_backends(collection_path):
        return True
    return None


def pytest_collection_modifyitems(config, items):
    """Tests marked `backends(...)` without this job's backend are
    deselected (not skipped: they belong to the other job)."""
    kept, dropped = [], []
    for item in items:
        marker = item.get_closest_marker("backends")
        if marker is None or BACKEND in marker.args:
            kept.append(item)
        else:
            dropped.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


sys.path.insert(0, os.path.dirname(__file__))

from keras_mgpu import _flavour  # noqa: E402

keras = _flavour.keras
IS_TF_KERAS = _flavour.IS_TF_KERAS

# The flavour is fixed per process: tests/legacy runs in its own pytest
# process with TF_USE_LEGACY_KERAS=1 (see tests/run_suite.py).
if IS_TF_KERAS:
    collect_ignore_glob = [
        "compression/*",
        "optimizers/*",
        "schedules/*",
        "callbacks/*",
        "layers/*",
        "monitoring/*",
        "normalization/*",
        "testing/*",
        "test_*.py",
    ]
else:
    collect_ignore_glob = ["legacy/*"]

# The strategy matrix and its fixtures (`strategy`, `strategy_name`,
# `mirrored_strategy`, `run_workers`) are keras_mgpu.testing's.
from keras_mgpu.testing import STRATEGY_NAMES, make_strategy  # noqa: E402

__all__ = ["STRATEGY_NAMES", "make_strategy"]


_FLAVOUR_AT_START = os.environ.get("TF_USE_LEGACY_KERAS")

if BACKEND == "jax":
    # Keras's own seeding imports TensorFlow on JAX whenever it is installed
    # (a keras_limit test says so); ours seeds the same without it.
    from keras_mgpu.testing import set_random_seed  # noqa: E402
else:
    set_random_seed = keras.utils.set_random_seed
# Its garbage collection is cheap over the frozen heap (see below).
clear_session = keras.backend.clear_session


def pytest_collection_finish(session):
    """Freeze what exists once the test modules are imported (TensorFlow,
    JAX, Keras, the modules: ~470k objects): the garbage collector skips it
    from then on. Keras's `clear_session()` runs a full collection, twice a
    test here; over the frozen heap it took 0.5-1.2 s on 2 cores (about a
    third of the TensorFlow job), over what the tests create since ~0.02 s.
    Cycles the tests make are still collected; what is frozen was alive
    when the tests started."""
    gc.collect()
    gc.freeze()


@pytest.fixture(autouse=True)
def _fresh_keras_session():
    """Clear Keras state and seed every RNG before each test."""
    clear_session()
    set_random_seed(1234)
    yield
    clear_session()
    # `import tensorflow_model_optimization` sets TF_USE_LEGACY_KERAS=1 in
    # os.environ; every later subprocess (workers, examples) would inherit
    # the other flavour. Put the session's value back and say who did it.
    if os.environ.get("TF_USE_LEGACY_KERAS") != _FLAVOUR_AT_START:
        if _FLAVOUR_AT_START is None:
            os.environ.pop("TF_USE_LEGACY_KERAS", None)
        else:
            os.environ["TF_USE_LEGACY_KERAS"] = _FLAVOUR_AT_START
        pytest.fail(
            "This test changed TF_USE_LEGACY_KERAS in os.environ (did it "
            "import tensorflow_model_optimization in-process?); restored.",
            pytrace=False,
        )

"""Shared test harness: logical devices, the strategy matrix, seeds.

The 4 logical CPU devices must be configured before TensorFlow initialises
its runtime, so this happens at import of this file, before any test module
(and before anything builds a strategy). Strategies are built inside
fixtures, never at collection time.

Mirrored strategies here use `ReductionToOneDevice`: on CPU the default
`CollectiveAllReduce` pins its collective group size at first use, so a
4-replica strategy after a 2-replica one fails in the same process
(keras-facts.md). The default cross-device ops, which users get, are covered
by tests that run in a process of their own (`tests/_processes.py`).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("PYTHONHASHSEED", "0")

import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

NUM_LOGICAL_CPUS = 4

_cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    _cpu, [tf.config.LogicalDeviceConfiguration()] * NUM_LOGICAL_CPUS
)

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
        "test_*.py",
    ]
else:
    collect_ignore_glob = ["legacy/*"]

STRATEGY_NAMES = (
    "default",
    "one_device",
    "mirrored_2",
    "mirrored_4",
    "central_storage",
)


def make_strategy(name: str) -> tf.distribute.Strategy:
    """Build one strategy of the matrix on the logical CPU devices."""
    cpus = [f"/cpu:{i}" for i in range(NUM_LOGICAL_CPUS)]
    if name == "default":
        return tf.distribute.get_strategy()
    if name == "one_device":
        return tf.distribute.OneDeviceStrategy("/cpu:0")
    if name.startswith("mirrored_"):
        replicas = int(name.split("_")[1])
        return tf.distribute.MirroredStrategy(
            devices=cpus[:replicas],
            cross_device_ops=tf.distribute.ReductionToOneDevice(),
        )
    if name == "central_storage":
        return tf.distribute.experimental.CentralStorageStrategy(
            compute_devices=cpus[:2], parameter_device="/cpu:0"
        )
    raise ValueError(f"Unknown strategy name {name!r}")


@pytest.fixture(params=STRATEGY_NAMES)
def strategy(request) -> tf.distribute.Strategy:
    """Each strategy of the matrix; `request.param` names it."""
    return make_strategy(request.param)


@pytest.fixture
def strategy_name(strategy, request) -> str:
    """The name of the strategy the `strategy` fixture built."""
    return request.node.callspec.params["strategy"]


_FLAVOUR_AT_START = os.environ.get("TF_USE_LEGACY_KERAS")


@pytest.fixture(autouse=True)
def _fresh_keras_session():
    """Clear Keras state and seed every RNG before each test."""
    keras.backend.clear_session()
    keras.utils.set_random_seed(1234)
    yield
    keras.backend.clear_session()
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

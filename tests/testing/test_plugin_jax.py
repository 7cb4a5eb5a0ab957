"""keras_mgpu.testing on JAX: the plugin in fresh pytest processes (through
pytester, `KERAS_BACKEND=jax`), the matrix in this one, and what refuses."""

from __future__ import annotations

import re

import keras
import numpy as np
import pytest

import keras_mgpu
from keras_mgpu.backend import BackendNotSupportedError
from keras_mgpu.testing import (
    JAX_STRATEGY_NAMES,
    STRATEGY_NAMES,
    make_strategy,
    mirrored_strategy,
    run_workers,
)

pytest_plugins = ["pytester"]

REPLICAS = {
    "default": 1,
    "data_parallel_1": 1,
    "data_parallel_2": 2,
    "data_parallel_4": 4,
    "model_parallel_2x2": 2,
}


def test_the_matrix_is_the_jax_one():
    assert STRATEGY_NAMES == JAX_STRATEGY_NAMES == tuple(REPLICAS)


def test_each_entry_trains_in_its_scope(strategy, strategy_name, cpu_devices):
    assert len(cpu_devices) == 4
    with strategy.scope():
        assert keras_mgpu.num_replicas_in_sync() == REPLICAS[strategy_name]
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
        model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, verbose=0)
    assert keras.distribution.distribution() is None  # the scope ended


def test_the_default_entry_clears_a_distribution_in_force():
    outer = make_strategy("data_parallel_2")
    with outer.scope():
        with make_strategy("default").scope():
            assert keras.distribution.distribution() is None
        assert keras.distribution.distribution() is outer
    assert keras_mgpu.num_replicas_in_sync(make_strategy("default")) == 1
    assert keras_mgpu.num_replicas_in_sync(outer) == 2


def test_unknown_names_and_too_many_devices_are_named():
    with pytest.raises(ValueError, match=r"on the jax backend\. Received"):
        make_strategy("mirrored_2")
    with pytest.raises(
        ValueError, match="'data_parallel_8' needs 8 CPU devices; 4 are"
    ):
        make_strategy("data_parallel_8")


def test_tensorflow_helpers_refuse_pointing_at_data_parallel():
    with pytest.raises(BackendNotSupportedError, match="DataParallel"):
        mirrored_strategy(2)
    # run_workers starts JAX clusters (tests/testing/test_run_workers_jax.py,
    # tests/distribute/test_jax_cluster_jax.py); only a TF_CONFIG chief
    # has no JAX meaning.
    with pytest.raises(ValueError, match="chief.*JAX cluster's process 0"):
        run_workers("m:f", 2, chief=True)


# ----------------------------------------------------------------------
# A user's project, in fresh pytest processes on JAX
# ----------------------------------------------------------------------
_USER_TESTS = """
import numpy as np
import keras
import keras_mgpu
from keras_mgpu.testing import assert_trains_like

def test_devices(cpu_devices):
    import jax
    print("DEVICES", len(jax.devices("cpu")), len(cpu_devices))

def test_matrix(strategy, strategy_name):
    with strategy.scope():
        print("RAN", strategy_name, keras_mgpu.num_replicas_in_sync())

def test_mirrored_refuses(mirrored_strategy):
    pass

X = np.random.default_rng(0).normal(size=(32, 3)).astype("float32")
Y = X.sum(axis=1, keepdims=True)

class Scaled(keras.Model):
    def compute_loss(self, *args, **kwargs):
        loss = super().compute_loss(*args, **kwargs)
        return loss * keras_mgpu.num_replicas_in_sync()

def build_scaled():
    inputs = keras.Input((3,))
    model = Scaled(inputs, keras.layers.Dense(1)(inputs))
    model.compile(keras.optimizers.SGD(0.1), "mse")
    return model

def test_scaled(strategy):
    assert_trains_like(build_scaled, (X, Y), strategy, steps=2)
"""


def _run(pytester, *args):
    pytester._monkeypatch.setenv("KERAS_BACKEND", "jax")
    return pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider", *args)


@pytest.mark.slow
def test_a_user_project_with_two_devices(pytester):
    pytester.makeini("[pytest]\nkeras_mgpu_cpu_devices = 2\n")
    # What must precede JAX's start, chosen in conftest.py (the plugin
    # only sets XLA_FLAGS before it, and starts JAX at no point).
    pytester.makeconftest(
        "import jax\njax.config.update('jax_num_cpu_devices', 2)\n"
    )
    pytester.makepyfile(test_user=_USER_TESTS)
    result = _run(pytester, "-v", "-rs")
    # default, data_parallel_1, data_parallel_2 run; the 4-device entries
    # skip. The loss scaled by the replica count trains alike on one
    # replica only. The mirrored_strategy fixture refuses (an error).
    result.assert_outcomes(passed=6, failed=1, skipped=4, errors=1)
    assert re.findall(r"DEVICES (\d+) (\d+)", result.stdout.str()) == [
        ("2", "2")
    ]
    result.stdout.fnmatch_lines(["*keras_mgpu.testing: 2 JAX CPU devices*"])
    for name, replicas in list(REPLICAS.items())[:3]:
        result.stdout.fnmatch_lines(
            [f"*test_matrix?{name}? RAN {name} {replicas}*"]
        )
    result.stdout.fnmatch_lines(
        [
            "*test_matrix?data_parallel_4? SKIPPED*",
            "*test_matrix?model_parallel_2x2? SKIPPED*",
            "*test_scaled?default? PASSED*",
            "*test_scaled?data_parallel_1? PASSED*",
            "*test_scaled?data_parallel_2? FAILED*",
            "*data_parallel_4 needs 4 CPU devices; 2 configured "
            "(keras_mgpu_cpu_devices = 2)*",
            "*model_parallel_2x2 needs 4 CPU devices; 2 configured*",
        ]
    )
    result.stdout.fnmatch_lines(
        ["*weight *kernel* under DataParallel (mesh 2) differs from no*"]
    )
    result.stdout.fnmatch_lines(
        ["*mirrored_strategy does not support the 'jax' backend*DataParallel*"]
    )

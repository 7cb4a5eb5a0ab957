"""keras_mgpu.testing: the pytest plugin (through pytester, in fresh
pytest processes of the backend under test) and its helpers. TensorFlow: a
user's project activating the plugin each way, its conftest's choices, the
errors, xdist, `run_workers` clusters. JAX: the matrix in this process, a
user's project with two devices, what refuses."""

from __future__ import annotations

import glob
import os
import re
import time

import numpy as np
import pytest
from conftest import BACKEND, keras

import keras_mgpu
from keras_mgpu.backend import BackendNotSupportedError
from keras_mgpu.testing import (
    JAX_STRATEGY_NAMES,
    STRATEGY_NAMES,
    WorkersFailed,
    make_strategy,
    mirrored_strategy,
    run_workers,
)

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.backends("tensorflow", "jax")
tensorflow_only = pytest.mark.backends("tensorflow")
jax_only = pytest.mark.backends("jax")


def _run(pytester, *args, capture: bool = False):
    """A fresh pytest process of this job's backend on pytester's files
    (`-s` unless `capture`: xdist's workers report captured output)."""
    pytester._monkeypatch.setenv("TF_CPP_MIN_LOG_LEVEL", "2")
    pytester._monkeypatch.setenv("KERAS_BACKEND", BACKEND)
    flags = ("-p", "no:cacheprovider") + (() if capture else ("-s",))
    return pytester.runpytest_subprocess(*flags, *args)


# ----------------------------------------------------------------------
# TensorFlow: a user's project in fresh pytest processes
# ----------------------------------------------------------------------
_COUNT_DEVICES = """
import sys
def test_devices():
    import tensorflow as tf
    print("DEVICES", len(tf.config.list_logical_devices("CPU")))
"""


def _devices(result) -> int:
    found = re.findall(r"DEVICES (\d+)", result.stdout.str())
    assert found, result.stdout.str()
    return int(found[0])


@pytest.mark.slow
@tensorflow_only
def test_inactive_unless_asked_tensorflow_untouched(pytester):
    pytester.makepyfile(
        test_untouched="""
import sys
def test_plugin_imported_nothing():
    assert "keras_mgpu" not in sys.modules
    assert "tensorflow" not in sys.modules
"""
        + _COUNT_DEVICES
    )
    result = _run(pytester)
    result.assert_outcomes(passed=2)
    assert _devices(result) == 1


@pytest.mark.slow
@tensorflow_only
def test_dash_p_activates_four_devices_and_the_fixtures_in_xdist_workers(
    pytester,
):
    # One inner run with `-n 2` (xdist): the plugin activated by `-p` gives
    # each worker process its 4 devices and the fixtures.
    pytester.makepyfile(
        test_fixtures="""
import numpy as np
import keras

def test_matrix(strategy, strategy_name, cpu_devices):
    import tensorflow as tf
    assert len(cpu_devices) == 4
    assert len(tf.config.list_logical_devices("CPU")) == 4
    with strategy.scope():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        model.compile("sgd", "mse")
    model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, verbose=0)
    print("RAN", strategy_name, strategy.num_replicas_in_sync)

def test_sizes_follow_each_other(mirrored_strategy):
    import tensorflow as tf
    for n in (2, 4, 2):
        s = mirrored_strategy(n)
        v = s.run(lambda: tf.constant(1.0))
        assert float(s.reduce("SUM", v, axis=None)) == n
"""
        + _COUNT_DEVICES
    )
    result = _run(
        pytester,
        "-p",
        "keras_mgpu.testing",
        "-n",
        "2",
        "-v",
        "-rP",
        capture=True,
    )
    result.assert_outcomes(passed=7)
    out = result.stdout.str()
    # xdist hands both workers tests once both have collected.
    for worker in ("gw0", "gw1"):
        assert re.search(rf"\[{worker}\] \[ *\d+%\] PASSED", out), out
    assert _devices(result) == 4
    ran = dict(
        re.findall(
            r"_ test_matrix\[(\w+)\] _+\n(?:\[gw\d\] .*\n)?"
            r"-+ Captured stdout call -+\nRAN \1 (\d+)",
            out,
        )
    )
    assert set(ran) == {
        "default",
        "one_device",
        "mirrored_2",
        "mirrored_4",
        "central_storage",
    }, out
    assert ran["mirrored_4"] == "4", out


@pytest.mark.slow
@tensorflow_only
def test_the_ini_option_activates_it(pytester):
    pytester.makeini("[pytest]\nkeras_mgpu_cpu_devices = 3\n")
    pytester.makepyfile(test_ini=_COUNT_DEVICES)
    result = _run(pytester)
    result.assert_outcomes(passed=1)
    assert _devices(result) == 3


@pytest.mark.slow
@tensorflow_only
def test_tensorflow_started_first_is_a_clear_error(pytester):
    pytester.makepyfile(
        early_tf="import tensorflow as tf\ntf.constant(1.0)\n",
        test_any="def test_x():\n    pass\n",
    )
    pytester.syspathinsert()
    result = _run(pytester, "-p", "early_tf", "-p", "keras_mgpu.testing")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        ["*could not split the CPU into 4 logical devices*already*"]
    )


# A conftest.py that chooses what must precede TensorFlow's runtime and
# keras_mgpu's flavour (issue 31, items 4 and 5), then starts the runtime.
_CHOOSING_CONFTEST = """
import os
os.environ["TF_USE_LEGACY_KERAS"] = "1"
import tensorflow as tf
tf.config.threading.set_intra_op_parallelism_threads(1)
for gpu in tf.config.list_physical_devices("GPU"):
    tf.config.experimental.set_memory_growth(gpu, True)
print("CONFTEST DEVICES", len(tf.config.list_logical_devices("CPU")))
"""

_CONFTEST_CHOICES_HOLD = """
def test_conftest_choices_hold(cpu_devices):
    import tensorflow as tf
    import tf_keras
    import keras_mgpu
    assert tf.config.threading.get_intra_op_parallelism_threads() == THREADS
    keras_mgpu.RecomputeGrad(tf_keras.layers.Dense(2))  # tf_keras flavour
    print("DEVICES", len(cpu_devices))
"""


@pytest.mark.slow
@tensorflow_only
def test_a_conftest_chooses_threads_and_flavour_and_two_devices_skip(
    pytester,
):
    # Activated by the ini option (the entry point): nothing of TensorFlow
    # or keras_mgpu runs before conftest.py; the CPU is split as soon as
    # conftest.py imports TensorFlow, so it may build tensors at import.
    pytester.makeini("[pytest]\nkeras_mgpu_cpu_devices = 2\n")
    pytester.makeconftest(_CHOOSING_CONFTEST)
    pytester.makepyfile(
        test_user="THREADS = 1\n"
        + _CONFTEST_CHOICES_HOLD
        + """
def test_matrix(strategy, strategy_name):
    print("RAN", strategy_name, strategy.num_replicas_in_sync)

def test_too_large_an_entry_by_name_is_named():
    import pytest
    from keras_mgpu.testing import make_strategy
    with pytest.raises(ValueError, match="'mirrored_4' needs 4 CPU devices; "
                       "2 are configured .keras_mgpu_cpu_devices = 2"):
        make_strategy("mirrored_4")
"""
    )
    result = _run(pytester, "-v", "-rs")
    result.assert_outcomes(passed=6, skipped=1)
    result.stdout.fnmatch_lines(["CONFTEST DEVICES 2"])
    result.stdout.fnmatch_lines(["*keras_mgpu.testing: 2 logical CPU devices*"])
    assert _devices(result) == 2
    for name, replicas in (("mirrored_2", 2), ("central_storage", 2)):
        result.stdout.fnmatch_lines([f"*RAN {name} {replicas}*"])
    result.stdout.fnmatch_lines(
        [
            "*test_matrix?mirrored_4? SKIPPED*",
            "*mirrored_4 needs 4 CPU devices; 2 configured "
            "(keras_mgpu_cpu_devices = 2)*",
        ]
    )


@pytest.mark.slow
@tensorflow_only
def test_dash_p_reads_the_flavour_a_conftest_sets(pytester):
    # `-p keras_mgpu.testing` imports keras_mgpu before conftest.py runs;
    # the flavour is read again after it (no component was built yet).
    pytester.makeconftest(
        'import os\nos.environ["TF_USE_LEGACY_KERAS"] = "1"\n'
    )
    pytester.makepyfile(test_user="THREADS = 0\n" + _CONFTEST_CHOICES_HOLD)
    result = _run(pytester, "-p", "keras_mgpu.testing")
    result.assert_outcomes(passed=1)
    assert _devices(result) == 4


@pytest.mark.slow
@tensorflow_only
def test_a_bad_device_count_is_a_usage_error(pytester):
    pytester.makeini("[pytest]\nkeras_mgpu_cpu_devices = four\n")
    pytester.makepyfile(test_any="def test_x():\n    pass\n")
    result = _run(pytester)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*keras_mgpu_cpu_devices must be a whole number >= 1*"
            "Received: keras_mgpu_cpu_devices='four'*"
        ]
    )
    assert "Traceback" not in result.stderr.str()


# ----------------------------------------------------------------------
# run_workers (a plain function; the fixture returns it). The bad
# arguments are named on every backend.
# ----------------------------------------------------------------------
@pytest.mark.slow
@tensorflow_only
def test_run_workers_returns_each_workers_result():
    results = run_workers(
        "plugin_worker_bodies:all_reduce_rank", 2, 0.5, timeout=150
    )
    assert [r["task"] for r in results] == ["worker:0", "worker:1"]
    assert [r["sum"] for r in results] == [1.5, 1.5]  # 0.5*1 + 0.5*2


@pytest.mark.slow
@tensorflow_only
def test_run_workers_chief_and_worker_cluster():
    from plugin_worker_bodies import all_reduce_rank

    results = run_workers(all_reduce_rank, 2, 1.0, timeout=150, chief=True)
    assert [(r["task"], r["rank"]) for r in results] == [
        ("chief:0", 0),
        ("worker:0", 1),
    ]
    assert {r["sum"] for r in results} == {3.0}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@tensorflow_only
def test_a_hang_times_out_and_leaves_no_process(tmp_path):
    pid_file = str(tmp_path / "pid")
    start = time.monotonic()
    with pytest.raises(WorkersFailed, match="did not finish within 8 s"):
        run_workers(
            "plugin_worker_bodies:sleep_forever", 2, pid_file, timeout=8
        )
    assert time.monotonic() - start < 30
    pids = [int(open(p).read()) for p in glob.glob(pid_file + ".*")]
    assert pids, "the workers never started"
    assert not any(_alive(pid) for pid in pids)


@pytest.mark.slow
@tensorflow_only
def test_a_failing_worker_shows_its_traceback_and_stops_its_peer():
    start = time.monotonic()
    with pytest.raises(WorkersFailed) as info:
        run_workers("plugin_worker_bodies:fail_on_worker_one", 2, timeout=120)
    assert "process 1 exited with 1" in str(info.value)
    assert "ValueError: boom on worker 1" in str(info.value)
    assert time.monotonic() - start < 60  # not the peer's 600 s sleep


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(fn=lambda: 1), "top level of an importable module"),
        (dict(fn="no_colon"), "'module:function'"),
        (dict(fn="m:f", num_workers=0), "num_workers"),
        (dict(fn="m:f", timeout=0), "timeout"),
    ],
)
def test_run_workers_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        run_workers(**kwargs)


# ----------------------------------------------------------------------
# JAX: the matrix in this process, and what refuses
# ----------------------------------------------------------------------
REPLICAS = {
    "default": 1,
    "data_parallel_1": 1,
    "data_parallel_2": 2,
    "data_parallel_4": 4,
    "model_parallel_2x2": 2,
}


@jax_only
def test_the_matrix_is_the_jax_one():
    assert STRATEGY_NAMES == JAX_STRATEGY_NAMES == tuple(REPLICAS)


@jax_only
def test_each_entry_trains_in_its_scope(strategy, strategy_name, cpu_devices):
    assert len(cpu_devices) == 4
    with strategy.scope():
        assert keras_mgpu.num_replicas_in_sync() == REPLICAS[strategy_name]
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile("sgd", "mse")
        model.fit(np.ones((8, 3)), np.ones((8, 2)), batch_size=4, verbose=0)
    assert keras.distribution.distribution() is None  # the scope ended


@jax_only
def test_the_default_entry_clears_a_distribution_in_force():
    outer = make_strategy("data_parallel_2")
    with outer.scope():
        with make_strategy("default").scope():
            assert keras.distribution.distribution() is None
        assert keras.distribution.distribution() is outer
    assert keras_mgpu.num_replicas_in_sync(make_strategy("default")) == 1
    assert keras_mgpu.num_replicas_in_sync(outer) == 2


@jax_only
def test_unknown_names_and_too_many_devices_are_named():
    with pytest.raises(ValueError, match=r"on the jax backend\. Received"):
        make_strategy("mirrored_2")
    with pytest.raises(
        ValueError, match="'data_parallel_8' needs 8 CPU devices; 4 are"
    ):
        make_strategy("data_parallel_8")


@jax_only
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


@jax_only
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

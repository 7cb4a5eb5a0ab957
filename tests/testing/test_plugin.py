"""keras_mgpu.testing: the pytest plugin (through pytester, in fresh
pytest processes) and its helpers."""

from __future__ import annotations

import glob
import os
import re
import time

import pytest

from keras_mgpu.testing import WorkersFailed, run_workers

pytest_plugins = ["pytester"]
pytestmark = pytest.mark.slow

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


def _run(pytester, *args):
    env = {"TF_CPP_MIN_LOG_LEVEL": "2"}
    for key, value in env.items():
        pytester._monkeypatch.setenv(key, value)
    return pytester.runpytest_subprocess("-s", "-p", "no:cacheprovider", *args)


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


def test_dash_p_activates_with_four_devices_and_the_fixtures(pytester):
    pytester.makepyfile(
        test_fixtures="""
import numpy as np
import keras

def test_matrix(strategy, strategy_name, cpu_devices):
    assert len(cpu_devices) == 4
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
    result = _run(pytester, "-p", "keras_mgpu.testing", "-v")
    result.assert_outcomes(passed=7)
    assert _devices(result) == 4
    for name in (
        "default",
        "one_device",
        "mirrored_2",
        "mirrored_4",
        "central_storage",
    ):
        result.stdout.fnmatch_lines([f"*test_matrix?{name}? RAN {name}*"])
    result.stdout.fnmatch_lines(["*RAN mirrored_4 4*"])


def test_the_ini_option_activates_it(pytester):
    pytester.makeini("[pytest]\nkeras_mgpu_cpu_devices = 3\n")
    pytester.makepyfile(test_ini=_COUNT_DEVICES)
    result = _run(pytester)
    result.assert_outcomes(passed=1)
    assert _devices(result) == 3


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


def test_works_with_pytest_xdist(pytester):
    body = """
def test_devices():
    import tensorflow as tf
    assert len(tf.config.list_logical_devices("CPU")) == 4
"""
    pytester.makepyfile(test_a=body, test_b=body)
    result = _run(pytester, "-p", "keras_mgpu.testing", "-n", "2")
    result.assert_outcomes(passed=2)


# ----------------------------------------------------------------------
# run_workers (a plain function; the fixture returns it)
# ----------------------------------------------------------------------
def test_run_workers_returns_each_workers_result():
    results = run_workers(
        "plugin_worker_bodies:all_reduce_rank", 2, 0.5, timeout=150
    )
    assert [r["task"] for r in results] == ["worker:0", "worker:1"]
    assert [r["sum"] for r in results] == [1.5, 1.5]  # 0.5*1 + 0.5*2


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

"""WorkerWatchdog, StragglerMonitor and JAX's key-value store on Keras's
JAX backend, in one process: the private client's methods (a JAX that
changes them fails here), the store's answers, the messages naming a JAX
process, and nothing running on one process. The 2-process runs are in
tests/distribute/test_jax_monitors_jax.py."""

from __future__ import annotations

import math
import sys
import threading

import pytest
from _training import mlp, regression_data

from keras_mgpu.backend.jax import kv_store, processes
from keras_mgpu.callbacks import StragglerMonitor, WorkerWatchdog
from keras_mgpu.callbacks.straggler_monitor import _waits_from_time_in_step
from keras_mgpu.distribute import worker_status
from keras_mgpu.monitoring import MonitorWarning, notices


@pytest.fixture(autouse=True)
def _no_tensorflow(monkeypatch):
    # Nothing here may import TensorFlow: an import now fails.
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    monkeypatch.setattr(notices, "_PROCESS_NOTES", set())


def test_jax_keeps_the_key_value_client_keras_mgpu_uses():
    """Fails when a JAX release moves or changes the private client
    (`jax._src.distributed.global_state.client`)."""
    from jax._src import distributed
    from jax._src.lib import _jax

    assert hasattr(distributed.global_state, "client")
    assert kv_store.missing_methods(_jax.DistributedRuntimeClient) == []


def test_a_changed_client_is_refused_naming_what_changed():
    class Old:
        def key_value_set(self, key, value):
            """key_value_set(self, key: str, value: str) -> None"""

    missing = kv_store.missing_methods(Old)
    assert missing == list(kv_store.REQUIRED_METHODS)  # no allow_overwrite
    error = kv_store._changed("9.9", f"its client lacks {missing[0]}")
    assert "This JAX (9.9) does not offer" in str(error)
    assert "checked with jax 0.10.2" in str(error)


def test_without_jax_distributed_the_store_is_refused_clearly():
    with pytest.raises(
        kv_store.KeyValueStoreUnavailable,
        match=r"needs jax\.distributed: call keras_mgpu\.distribute\."
        r"start_cluster\(\)",
    ):
        kv_store.JaxKeyValueStore()


class _FakeClient:
    """The client's key-value calls, in memory, with its errors' texts."""

    def __init__(self, fail: str | None = None) -> None:
        self.values: dict[str, str] = {}
        self.fail = fail
        self.calls: list = []

    def key_value_set(self, key, value, allow_overwrite=False):
        self.calls.append(("set", key, allow_overwrite))
        if key in self.values and not allow_overwrite:
            raise RuntimeError(f"ALREADY_EXISTS: key {key} already exists.")
        self.values[key] = value

    def key_value_try_get(self, key):
        if self.fail:
            raise RuntimeError(self.fail)
        if key not in self.values:
            raise RuntimeError(f"NOT_FOUND: Config key {key} not found.")
        return self.values[key]

    def key_value_delete(self, key):
        for k in [k for k in self.values if k == key or k.startswith(key)]:
            del self.values[k]

    def key_value_dir_get(self, key):
        return [(k, v) for k, v in self.values.items() if k.startswith(key)]


def test_the_store_overwrites_and_reads_a_missing_key_as_none():
    client = _FakeClient()
    store = kv_store.JaxKeyValueStore(client)
    store.set("a/0", "1")
    store.set("a/0", "2")
    assert store.get("a/0", 1.0) == "2"
    assert store.get("a/1", 1.0) is None
    assert store.items("a/") == [("a/0", "2")]
    store.delete("a")
    assert store.items("a/") == []
    assert all(overwrite for _, _, overwrite in client.calls)


def test_a_failing_service_is_an_error_not_a_missing_status():
    store = kv_store.JaxKeyValueStore(
        _FakeClient(fail="UNAVAILABLE: Socket closed")
    )
    status = worker_status.WorkerStatus(
        0, ["process:0", "process:1"], "run0", store=store
    )
    ((status_read, error),) = status.read_peers().values()
    assert status_read is None
    assert error == "RuntimeError: UNAVAILABLE: Socket closed"


def test_two_processes_statuses_through_the_store():
    """The two-slot publication works on JAX's overwriting store too: a
    reader sees the newest status, and none once the writer removed it."""
    store = kv_store.JaxKeyValueStore(_FakeClient())
    names = ["process:0", "process:1"]
    writer = worker_status.WorkerStatus(0, names, "run0", store=store)
    reader = worker_status.WorkerStatus(1, names, "run0", store=store)
    for seq in range(1, 5):
        writer.publish({"seq": seq})
        status, error = reader.read_peers()[0]
        assert error is None and status["seq"] == seq
    writer.remove()
    assert reader.read_peers()[0] == (None, None)


def _jax_status(**fields):
    return {
        "name": "process:1 (host-b, pid 42)",
        "seq": 7,
        "phase": "train",
        "step": 12,
        "epoch": 0,
        "progress": 12,
        "in_step": True,
        "in_tensorflow": True,
        "framework": "JAX",
        "where": "pjit.py:1 in _pjit_call_impl",
        "for": 3.0,
        "ended": None,
        **fields,
    }


OWN = {"name": "process:0 (host-a, pid 41)", "phase": "train", "step": 12}
JAX_SERVICE = "JAX's distributed service (on process 0)"


def _describe(record, now, run_age=100.0):
    return record.describe(
        OWN, now, run_age, stale_after=5.0, grace=30.0, service=JAX_SERVICE
    )


def test_a_jax_peer_is_named_with_its_host_and_pid_once_seen():
    record = worker_status.PeerRecord("process:1")
    assert _describe(record, 0.0, run_age=40.0)[1].startswith(
        "process:1: no status within 40 s of this worker's start (never "
        "started this run, or process 0 that hosts JAX's distributed "
        "service is gone)"
    )
    record.observe(_jax_status(), None, 0.0)
    assert _describe(record, 1.0) == (
        "ok",
        "process:1 (host-b, pid 42): in train step 12 inside JAX for 3 s "
        "(waiting too, or stuck computing)",
    )
    record.observe(None, "RuntimeError: UNAVAILABLE", 2.0)
    verdict, text = _describe(record, 8.0)
    assert verdict == "gone"
    assert text == (
        "process:1 (host-b, pid 42): unknown, JAX's distributed service "
        "(on process 0) has not answered for 6 s (RuntimeError: "
        "UNAVAILABLE; process 0 killed?)"
    )


def test_the_watchdog_constructs_on_jax_and_idles_on_one_process():
    watchdog = WorkerWatchdog(timeout=1.0, heartbeat_interval=0.1)
    x, y = regression_data(16)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    before = set(threading.enumerate())
    model.fit(x, y, batch_size=8, epochs=1, verbose=0, callbacks=[watchdog])
    assert watchdog.report is None
    assert not [
        t
        for t in set(threading.enumerate()) - before
        if t.name.startswith("keras_mgpu")
    ]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"timeout": 0}, r"Argument `timeout` must be a number > 0"),
        (
            {"timeout": 2, "heartbeat_interval": 3},
            r"`heartbeat_interval` must be smaller than `timeout`",
        ),
    ],
)
def test_watchdog_bad_arguments_as_on_tensorflow(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WorkerWatchdog(**kwargs)


def test_the_exit_status_is_documented():
    assert processes.EXIT_CODE == 75
    assert "status 75" in WorkerWatchdog.__doc__


def test_straggler_monitor_on_one_jax_process_logs_nothing():
    monitor = StragglerMonitor()
    x, y = regression_data(16)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(MonitorWarning, match="needs several JAX processes"):
        history = model.fit(x, y, epochs=1, verbose=0, callbacks=[monitor])
    assert not any(k.startswith("workers/") for k in history.history)
    assert monitor.keys == []


def test_waits_are_the_time_in_step_beyond_the_least():
    figures = {
        "workers/w0_step_ms": 60.0,
        "workers/w0_wait_ms": 55.0,  # time in the step, before
        "workers/w0_busy_ms": math.nan,
        "workers/w1_step_ms": 61.0,
        "workers/w1_wait_ms": 10.0,
        "workers/w1_busy_ms": math.nan,
    }
    _waits_from_time_in_step(figures, 2)
    assert figures["workers/w0_wait_ms"] == 45.0
    assert figures["workers/w1_wait_ms"] == 0.0
    assert figures["workers/w0_busy_ms"] == 15.0
    assert figures["workers/w1_busy_ms"] == 61.0


def test_the_step_timer_splits_batch_fetch_from_the_step():
    """The wrapper hands the batches on, times their fetch apart, and goes
    away with `uninstall` (also after a fit that left it installed)."""
    import time

    from keras_mgpu.backend.jax import step_timing

    class Model:
        def train_function(self, state, iterator):
            batch = next(iterator)
            time.sleep(0.02)
            return {"loss": batch}, state

    def slow_batches():
        while True:
            time.sleep(0.03)
            yield 1.0

    model = Model()
    own = model.train_function
    timer = step_timing.StepTimer()
    assert timer.install(model)
    assert timer.install(model)  # re-installing unwraps first
    logs, _ = model.train_function("state", slow_batches())
    assert logs == {"loss": 1.0}
    assert timer.steps == 1
    assert 0.03 <= timer.data < 0.02 + 0.03 + 0.5
    assert 0.02 <= timer.in_step < timer.data + 0.5
    step_timing.uninstall(model)
    assert model.train_function == own


def test_several_processes_without_jax_distributed_fail_clearly(monkeypatch):
    """Several processes counted but no `jax.distributed` client (faked):
    the watched `fit` fails at its start naming what to call, and starts
    no thread."""
    from keras_mgpu.distribute import strategy

    two = {"rank": 0, "num_workers": 2}
    monkeypatch.setattr(strategy, "worker_info", lambda s=None: two)
    watchdog = WorkerWatchdog(timeout=1.0, heartbeat_interval=0.1)
    x, y = regression_data(16)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    before = set(threading.enumerate())
    with pytest.raises(
        kv_store.KeyValueStoreUnavailable, match=r"needs jax\.distributed"
    ):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[watchdog])
    assert not [
        t
        for t in set(threading.enumerate()) - before
        if t.name.startswith("keras_mgpu")
    ]


def test_the_step_timer_goes_once_the_fit_that_installed_it_left():
    """`fit` raised (no on_train_end): the next call of the train function
    is not timed (Keras's asynchronous dispatch stays) and unwraps it."""
    from keras_mgpu.backend.jax import step_timing

    class Model:
        def train_function(self, state, iterator):
            return {"loss": next(iterator)}, state

    def gone_fit_frame():
        return sys._getframe()  # leaves the stack when this returns

    model = Model()
    own = model.train_function
    timer = step_timing.StepTimer()
    assert timer.install(model, watch_frame=gone_fit_frame())
    assert model.train_function != own
    assert model.train_function("state", iter([2.0])) == (
        {"loss": 2.0},
        "state",
    )
    assert timer.steps == 0 and not timer.active
    assert model.train_function == own

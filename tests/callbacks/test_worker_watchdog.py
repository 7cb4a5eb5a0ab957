"""WorkerWatchdog and its status messages, StragglerMonitor's timing hook,
and on JAX the key-value store, without a cluster, on both backends (the
cluster runs are in tests/distribute/test_watchdog_faults.py,
test_worker_failures.py and test_jax_monitors_jax.py).

The JAX tests check the private client's methods (a JAX that changes them
fails here), the store's answers and the messages naming a JAX process;
nothing in them may import TensorFlow. The status-record logic is backend
independent: the TensorFlow job checks it."""

from __future__ import annotations

import math
import sys
import threading
import time

import pytest
from _training import mlp, regression_data

from keras_mgpu._flavour import keras, tf
from keras_mgpu.callbacks import StragglerMonitor, WorkerWatchdog
from keras_mgpu.callbacks.straggler_monitor import _waits_from_time_in_step
from keras_mgpu.distribute import collective_timing, worker_status
from keras_mgpu.monitoring import MonitorWarning, notices

pytestmark = pytest.mark.backends("tensorflow", "jax")

JAX = keras.backend.backend() == "jax"
TF_ONLY = pytest.mark.backends("tensorflow")
JAX_ONLY = pytest.mark.backends("jax")
if JAX:
    from keras_mgpu.backend.jax import kv_store, processes


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    monkeypatch.setattr(notices, "_PROCESS_NOTES", set())
    if JAX:
        # Nothing here may import TensorFlow on JAX: an import now fails.
        monkeypatch.setitem(sys.modules, "tensorflow", None)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"timeout": 0}, r"Argument `timeout` must be a number > 0"),
        ({"timeout": -5}, r"Received: timeout=-5"),
        ({"heartbeat_interval": 0}, r"`heartbeat_interval` must be"),
        (
            {"timeout": 2, "heartbeat_interval": 3},
            r"`heartbeat_interval` must be smaller than `timeout`\. "
            r"Received: heartbeat_interval=3, timeout=2",
        ),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        WorkerWatchdog(**kwargs)


def test_bad_argument_type():
    with pytest.raises(TypeError, match=r"Received: timeout='soon'"):
        WorkerWatchdog(timeout="soon")


def test_nothing_runs_outside_multi_worker_training():
    watchdog = WorkerWatchdog(timeout=1.0, heartbeat_interval=0.1)
    x, y = regression_data(16)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    before = set(threading.enumerate())
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        verbose=0,
        validation_data=(x, y),
        callbacks=[watchdog],
    )
    model.evaluate(x, y, verbose=0, callbacks=[watchdog])
    model.predict(x, verbose=0, callbacks=[watchdog])
    assert watchdog.report is None
    assert not [
        t
        for t in set(threading.enumerate()) - before
        if t.name.startswith("keras_mgpu")
    ]


def _status(**fields):
    return {
        "name": "worker:1 (10.0.0.2:2222)",
        "seq": 7,
        "phase": "train",
        "step": 12,
        "epoch": 0,
        "progress": 12,
        "in_step": True,
        "in_tensorflow": True,
        "where": "execute.py:53 in quick_execute",
        "for": 3.0,
        "ended": None,
        **fields,
    }


OWN = {
    "name": "chief:0 (10.0.0.1:2222)",
    "phase": "train",
    "step": 12,
    "progress": 12,
    "in_step": True,
}


def _record(*reads, name="worker:1 (10.0.0.2:2222)"):
    """A PeerRecord after `reads`: (status, error, monotonic time)."""
    record = worker_status.PeerRecord(name)
    for status, error, at in reads:
        record.observe(status, error, at)
    return record


def _describe(record, now, run_age=100.0):
    return record.describe(OWN, now, run_age, stale_after=5.0, grace=30.0)


@TF_ONLY
def test_a_peer_whose_heartbeat_stops_is_gone_by_this_workers_clock():
    beating = _record((_status(seq=1), None, 0.0), (_status(seq=2), None, 4.0))
    assert _describe(beating, 8.0)[0] == "ok"  # changed 4 s ago
    verdict, text = _describe(beating, 9.5)
    assert verdict == "gone"
    assert text == (
        "worker:1 (10.0.0.2:2222): no heartbeat for 6 s (process killed, "
        "crashed or frozen)"
    )


@TF_ONLY
def test_a_peer_without_status_is_given_the_start_up_grace():
    never = _record((None, None, 0.0), (None, None, 20.0))
    assert _describe(never, 20.0, run_age=29.0) == (
        "ok",
        "worker:1 (10.0.0.2:2222): not started yet",
    )
    verdict, text = _describe(never, 20.0, run_age=31.0)
    assert verdict == "gone"
    assert "no status within 31 s of this worker's start" in text


@TF_ONLY
def test_a_peer_that_left_or_finished_the_run():
    left = _record((_status(ended="its fit call raised"), None, 0.0))
    assert _describe(left, 0.5) == (
        "gone",
        "worker:1 (10.0.0.2:2222): left the run (its fit call raised)",
    )
    finished = _record((_status(), None, 0.0), (None, None, 1.0))
    assert _describe(finished, 30.0)[0] == "ok"


@TF_ONLY
def test_an_unreachable_store_counts_after_stale_after():
    record = _record(
        (_status(), None, 0.0),
        (None, "UnavailableError: socket closed", 1.0),
    )
    assert _describe(record, 5.0)[0] == "ok"  # failing for 4 s only
    verdict, text = _describe(record, 6.5)
    assert verdict == "gone"
    assert "coordination service (on the chief) has not answered" in text


@TF_ONLY
def test_a_peer_stuck_in_python_is_named_with_the_place_and_phase():
    status = _status(
        phase="validation",
        step=2,
        epoch=1,
        in_step=False,
        in_tensorflow=False,
        where="data.py:40 in __getitem__",
        **{"for": 40.0},
    )
    verdict, text = _describe(_record((status, None, 0.0)), 1.0)
    assert verdict == "suspect"
    assert text == (
        "worker:1 (10.0.0.2:2222): stalled in Python for 40 s at data.py:40 "
        "in __getitem__ (after validation step 2 (epoch 1))"
    )


@TF_ONLY
def test_a_peer_behind_and_one_waiting_too():
    behind = _record((_status(progress=11, step=11), None, 0.0))
    waiting = _record((_status(phase="predict", step=3), None, 0.0))
    assert _describe(behind, 1.0) == (
        "suspect",
        "worker:1 (10.0.0.2:2222): behind, still in train step 11",
    )
    verdict, text = _describe(waiting, 1.0)
    assert verdict == "ok"
    assert "in predict step 3 inside TensorFlow for 3 s (waiting too" in text


@TF_ONLY
def test_message_names_only_the_missing_workers():
    lines = [
        ("ok", "worker:0 (h:1): in train step 12 inside TensorFlow"),
        ("gone", "worker:1 (h:2): no heartbeat for 6 s"),
    ]
    text = worker_status.missing_workers_message(OWN, lines, 31.0)
    assert text.startswith(
        "keras_mgpu WorkerWatchdog: chief:0 (10.0.0.1:2222) waited 31 s in "
        "train step 12 for missing worker(s): worker:1 (h:2): no heartbeat"
    )
    assert "worker:0" not in text
    assert "Restart every worker of the job" in text
    nobody = worker_status.missing_workers_message(OWN, lines[:1], 31)
    assert "none is missing; a collective may be stuck" in nobody
    assert "worker:0 (h:1): in train step 12" in nobody


@TF_ONLY
def test_a_thread_waiting_in_the_standard_library_is_named_by_its_caller():
    # An eager all-reduce waits on a multiprocessing pool: the place to
    # name is the first frame outside Python's own library.
    release = threading.Event()

    def waits_for_peers():
        release.wait(30)

    thread = threading.Thread(target=waits_for_peers)
    thread.start()
    try:
        for _ in range(100):
            inside, where = worker_status.describe_frame(thread.ident)
            if "waits_for_peers" in where:
                break
            time.sleep(0.01)
        assert not inside
        assert where.startswith(__file__)
        assert where.endswith(" in waits_for_peers")
    finally:
        release.set()
        thread.join()


@TF_ONLY
def test_a_hung_store_call_blocks_neither_the_caller_nor_the_exit():
    status = worker_status.WorkerStatus(0, ["chief:0 (h:1)", "w"], "run0")
    release = threading.Event()
    hung = status._start("write", release.wait, 30)
    with pytest.raises(TimeoutError):
        hung.result(timeout=0.05)
    # The next heartbeat is skipped, not queued behind the hung one.
    with pytest.raises(TimeoutError, match="previous write has not returned"):
        status._start("write", int)
    assert all(
        t.daemon for t in threading.enumerate() if t.name == "keras_mgpu-kv"
    )
    release.set()
    assert hung.result(timeout=5) is True
    assert status._start("write", int).result(timeout=5) == 0


@TF_ONLY
def test_when_in_run():
    when = worker_status.when_in_run
    assert when({"phase": "train", "step": 0}) == "before the first train step"
    assert when({"phase": "predict", "step": 1, "in_step": True}) == (
        "in predict step 1"
    )
    assert when({"phase": "validation", "step": 2, "epoch": 3}) == (
        "after validation step 2 (epoch 3)"
    )


@TF_ONLY
def test_the_timing_hook_goes_when_its_frame_is_gone():
    from tensorflow.python.distribute import cross_device_utils

    launcher = cross_device_utils.CollectiveReplicaLauncher
    original = launcher.all_reduce

    def fit_that_raises():
        token = collective_timing.install(watch_frame=sys._getframe())
        assert token is not None and collective_timing.installed()
        assert launcher.all_reduce is not original
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        fit_that_raises()
    assert not collective_timing.installed()
    assert launcher.all_reduce is original
    # Tokens: an owner that uninstalls after being dropped changes nothing,
    # and a live holder keeps the hook.
    held = collective_timing.install()
    collective_timing.uninstall(12345)
    assert collective_timing.installed()
    collective_timing.uninstall(held)
    assert not collective_timing.installed()
    assert launcher.all_reduce is original


@TF_ONLY
def test_straggler_monitor_hook_goes_when_fit_raises(monkeypatch):
    from keras_mgpu.distribute import strategy as strategy_module

    # Pretend to be a worker of a 2-worker cluster: on_train_begin installs
    # the hook; fit then raises before any epoch ends.
    monkeypatch.setattr(strategy_module, "is_multi_worker", lambda s: True)
    monkeypatch.setattr(
        strategy_module,
        "worker_info",
        lambda s=None: {"rank": 0, "num_workers": 2},
    )

    class Boom(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch, logs=None):
            assert collective_timing.installed()
            raise RuntimeError("boom")

    x, y = regression_data(16)
    with tf.distribute.OneDeviceStrategy("/cpu:0").scope():
        model = mlp()
        model.compile(optimizer="sgd", loss="mse")
    monitor = StragglerMonitor()
    with pytest.raises(RuntimeError, match="boom"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[monitor, Boom()])
    assert not collective_timing.installed()


def test_straggler_monitor_logs_nothing_outside_multi_worker():
    monitor = StragglerMonitor()
    x, y = regression_data(16)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    needs = "several JAX processes" if JAX else "MultiWorkerMirroredStrategy"
    with pytest.warns(MonitorWarning, match=f"needs {needs}"):
        history = model.fit(x, y, epochs=1, verbose=0, callbacks=[monitor])
    assert not any(k.startswith("workers/") for k in history.history)
    assert monitor.keys == []


@pytest.mark.parametrize("warn_ratio", [1.0, 0.5, "big"])
def test_straggler_monitor_bad_warn_ratio(warn_ratio):
    with pytest.raises((ValueError, TypeError), match="warn_ratio"):
        StragglerMonitor(warn_ratio=warn_ratio)


class _RecordingStore:
    """The coordination service's key-value calls, in memory: the store
    does not overwrite a key (as TensorFlow's), deleting a folder deletes
    its keys, and after every change a peer reads the writer's status
    (the sequence of what a reader can ever see, with no timing)."""

    def __init__(self, die_at_change: int | None = None) -> None:
        self.values: dict[str, str] = {}
        self.changes = 0
        self.die_at_change = die_at_change
        self.seen: list = []
        self.reader = None

    def _changed(self) -> None:
        self.changes += 1
        if self.reader is not None:
            self.seen.append(self.reader.read_peers()[0])
        if self.changes == self.die_at_change:
            raise SystemExit("killed")  # the writer dies here

    def set_config_key_value(self, key, value):
        if key in self.values:
            raise tf.errors.AlreadyExistsError(None, None, key)
        self.values[key] = value
        self._changed()

    def delete_config_key_value(self, key):
        gone = [k for k in self.values if k == key or k.startswith(key + "/")]
        if not gone:
            raise tf.errors.NotFoundError(None, None, key)
        for k in gone:
            del self.values[k]
        self._changed()

    def get_config_key_value(self, key, timeout_in_ms=0):
        if key not in self.values:
            raise tf.errors.NotFoundError(None, None, key)
        return self.values[key]


@TF_ONLY
@pytest.mark.parametrize("die_at_change", [None, 3, 4, 5, 6, 7])
def test_a_reader_never_sees_a_publishing_worker_as_finished(
    die_at_change, monkeypatch
):
    """Between two publications, and after the writer dies at any change
    of the store, a peer reads the writer's latest status, never "no
    status" (which the watchdog reads as "finished the run": a killed
    worker was taken for a finished one and peers waited the timeout)."""
    from tensorflow.python.eager import context

    store = _RecordingStore(die_at_change)
    monkeypatch.setattr(context, "context", lambda: store)
    names = ["worker:0 (h:1)", "worker:1 (h:2)"]
    writer = worker_status.WorkerStatus(0, names, "run0")
    store.reader = worker_status.WorkerStatus(1, names, "run0")
    published = 0
    for seq in range(1, 6):
        try:
            writer.publish({"seq": seq})
        except SystemExit:
            break
        published = seq
    assert store.seen, "nothing was read"
    first = next(i for i, (s, _) in enumerate(store.seen) if s is not None)
    seqs = []
    for status, error in store.seen[first:]:
        assert error is None
        assert status is not None, store.seen  # never "finished"
        seqs.append(status["seq"])
    assert seqs == sorted(seqs)  # never an older status after a newer
    # After the last change the peer reads the last complete publication
    # (or the one being written, if its slot was set before the death).
    status, _ = store.reader.read_peers()[0]
    assert status["seq"] in (published, published + 1)
    if die_at_change is None:
        assert status["seq"] == 5
        writer.remove()
        assert store.reader.read_peers()[0] == (None, None)
        assert store.values == {}


@TF_ONLY
def test_a_late_batch_end_ends_only_its_own_step():
    """Keras's asynchronous dispatch may run step n's end hook after step
    n + 1 began; with `steps_per_execution` an execution begins at its
    first batch and ends at its last."""
    watchdog = WorkerWatchdog()
    assert watchdog.async_safe
    watchdog.on_train_batch_begin(0)
    watchdog.on_train_batch_begin(1)  # before step 0's end hook ran
    watchdog.on_train_batch_end(0)
    assert watchdog._state["in_step"]
    watchdog.on_train_batch_end(1)
    assert not watchdog._state["in_step"]
    watchdog.on_train_batch_begin(2)
    watchdog.on_train_batch_end(5)  # steps_per_execution=4
    assert not watchdog._state["in_step"]
    watchdog.on_test_begin()
    watchdog.on_test_batch_begin(0)
    watchdog.on_train_batch_end(7)  # a train step's late end: not a test's
    assert watchdog._state["in_step"]


@JAX_ONLY
def test_jax_keeps_the_key_value_client_keras_mgpu_uses():
    """Fails when a JAX release moves or changes the private client
    (`jax._src.distributed.global_state.client`)."""
    from jax._src import distributed
    from jax._src.lib import _jax

    assert hasattr(distributed.global_state, "client")
    assert kv_store.missing_methods(_jax.DistributedRuntimeClient) == []


@JAX_ONLY
def test_a_changed_client_is_refused_naming_what_changed():
    class Old:
        def key_value_set(self, key, value):
            """key_value_set(self, key: str, value: str) -> None"""

    missing = kv_store.missing_methods(Old)
    assert missing == list(kv_store.REQUIRED_METHODS)  # no allow_overwrite
    error = kv_store._changed("9.9", f"its client lacks {missing[0]}")
    assert "This JAX (9.9) does not offer" in str(error)
    assert "checked with jax 0.10.2" in str(error)


@JAX_ONLY
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


@JAX_ONLY
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


@JAX_ONLY
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


@JAX_ONLY
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


JAX_OWN = {"name": "process:0 (host-a, pid 41)", "phase": "train", "step": 12}
JAX_SERVICE = "JAX's distributed service (on process 0)"


def _describe_jax(record, now, run_age=100.0):
    return record.describe(
        JAX_OWN, now, run_age, stale_after=5.0, grace=30.0, service=JAX_SERVICE
    )


@JAX_ONLY
def test_a_jax_peer_is_named_with_its_host_and_pid_once_seen():
    record = worker_status.PeerRecord("process:1")
    assert _describe_jax(record, 0.0, run_age=40.0)[1].startswith(
        "process:1: no status within 40 s of this worker's start (never "
        "started this run, or process 0 that hosts JAX's distributed "
        "service is gone)"
    )
    record.observe(_jax_status(), None, 0.0)
    assert _describe_jax(record, 1.0) == (
        "ok",
        "process:1 (host-b, pid 42): in train step 12 inside JAX for 3 s "
        "(waiting too, or stuck computing)",
    )
    record.observe(None, "RuntimeError: UNAVAILABLE", 2.0)
    verdict, text = _describe_jax(record, 8.0)
    assert verdict == "gone"
    assert text == (
        "process:1 (host-b, pid 42): unknown, JAX's distributed service "
        "(on process 0) has not answered for 6 s (RuntimeError: "
        "UNAVAILABLE; process 0 killed?)"
    )


@JAX_ONLY
def test_the_exit_status_is_documented():
    assert processes.EXIT_CODE == 75
    assert "status 75" in WorkerWatchdog.__doc__


@JAX_ONLY
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


@JAX_ONLY
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


@JAX_ONLY
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


@JAX_ONLY
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

"""WorkerWatchdog and its status messages without a cluster (the 2-worker
kill and stall runs are in tests/distribute/test_worker_failures.py)."""

from __future__ import annotations

import threading
import time

import pytest
from _training import mlp, regression_data

from keras_mgpu.callbacks import StragglerMonitor, WorkerWatchdog
from keras_mgpu.distribute import worker_status
from keras_mgpu.monitoring.backend import MonitorWarning


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


def test_nothing_runs_outside_multi_worker_training():
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


def _status(**fields):
    now = time.time()
    return {
        "step": 12,
        "in_step": True,
        "in_tensorflow": True,
        "where": "execute.py:53 in quick_execute",
        "since": now - 3,
        "beat": now,
        "address": "10.0.0.2:2222",
        **fields,
    }


def test_a_peer_without_heartbeat_is_gone():
    status = _status(beat=time.time() - 30)
    missing, text = worker_status.describe_peer(1, status, 12, 5.0)
    assert missing and "worker 1 (10.0.0.2:2222): no heartbeat for 30 s" in text


def test_a_peer_stuck_in_python_is_named_with_the_place():
    status = _status(
        in_step=False,
        in_tensorflow=False,
        since=time.time() - 40,
        where="data.py:40 in __getitem__",
    )
    missing, text = worker_status.describe_peer(1, status, 13, 5.0)
    assert missing
    assert text == (
        "worker 1 (10.0.0.2:2222): stalled in Python for 40 s at data.py:40 "
        "in __getitem__ (after step 12)"
    )


def test_a_peer_behind_and_one_waiting_too():
    behind = worker_status.describe_peer(2, _status(step=11), 12, 5.0)
    waiting = worker_status.describe_peer(3, _status(), 12, 5.0)
    assert behind == (
        True,
        "worker 2 (10.0.0.2:2222): behind, still in step 11",
    )
    assert waiting[0] is False and "waiting too" in waiting[1]


def test_message_names_only_the_missing_workers():
    own = {"task_id": 0, "step": 12}
    peers = {1: _status(), 2: None}
    text = worker_status.missing_workers_message(own, peers, 31.0, 5.0)
    assert text.startswith(
        "keras_mgpu WorkerWatchdog: worker 0 waited 31 s in step 12 for "
        "missing worker(s): worker 2: no status"
    )
    assert "worker 1" not in text
    assert "Restart every worker of the job" in text
    nobody = worker_status.missing_workers_message(own, {1: _status()}, 31, 5)
    assert "none is missing; a collective may be stuck" in nobody
    assert "worker 1 (10.0.0.2:2222): in step 12" in nobody


def test_straggler_monitor_logs_nothing_outside_multi_worker():
    monitor = StragglerMonitor()
    x, y = regression_data(16)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(
        MonitorWarning, match="needs MultiWorkerMirroredStrategy"
    ):
        history = model.fit(x, y, epochs=1, verbose=0, callbacks=[monitor])
    assert not any(k.startswith("workers/") for k in history.history)
    assert monitor.keys == []


@pytest.mark.parametrize("warn_ratio", [1.0, 0.5, "big"])
def test_straggler_monitor_bad_warn_ratio(warn_ratio):
    with pytest.raises((ValueError, TypeError), match="warn_ratio"):
        StragglerMonitor(warn_ratio=warn_ratio)

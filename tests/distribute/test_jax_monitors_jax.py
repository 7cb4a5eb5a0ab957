"""The cluster monitors across the processes of a JAX cluster (2 processes
x 2 CPU devices on 127.0.0.1): JAX's key-value store through keras_mgpu's
wrapper, `StragglerMonitor` and `MemoryMonitor(gather_workers=True)` (and
`GPULoadMonitor`'s, which shares the gathering) log every process's keys on
every process, as on TensorFlow; `WorkerWatchdog` names a process stalled
in a callback, or frozen, within its bound and ends the run with status 75;
a SIGKILLed process ends the run within the bound.

Three clusters (bodies in tests/distribute/jax_monitor_bodies.py): one runs
every scenario that keeps the cluster alive and then the stall; one the
SIGKILL; one the freeze (SIGSTOP). Bounds have margins for a loaded 2-core
machine.
"""

from __future__ import annotations

import os
import pickle
import re

import jax_monitor_bodies as bodies
import pytest
from _jax_fault_runner import run_jax_cluster

from keras_mgpu.backend.jax.processes import EXIT_CODE

pytestmark = pytest.mark.slow

MARGIN = 6.0  # seconds past a bound: a heartbeat, a read, a loaded host
STALE_AFTER = 5.0  # max(3 x HEARTBEAT, 5 s)


def _moment(out, name):
    with open(os.path.join(out, name)) as f:
        return float(f.read())


@pytest.fixture(scope="module")
def stall_cluster(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("jax_monitors"))
    runs = run_jax_cluster(
        "jax_monitor_bodies:monitors_then_stall", 2, out, timeout=180
    )
    seen = []
    for rank in range(2):
        path = os.path.join(out, f"{rank}.pkl")
        assert os.path.exists(path), runs[rank]["output"][-3000:]
        with open(path, "rb") as f:
            seen.append(pickle.load(f))
    return {"runs": runs, "seen": seen, "out": out}


def _fault_cluster(tmp_path_factory, action):
    out = str(tmp_path_factory.mktemp(f"jax_{action}"))
    runs = run_jax_cluster(
        "jax_monitor_bodies:kill", 2, out, action, timeout=180, may_hang=(1,)
    )
    return {"runs": runs, "out": out}


@pytest.fixture(scope="module")
def kill_cluster(tmp_path_factory):
    return _fault_cluster(tmp_path_factory, "kill")


@pytest.fixture(scope="module")
def freeze_cluster(tmp_path_factory):
    return _fault_cluster(tmp_path_factory, "freeze")


# ---------------------------------------------------------------------------
# The key-value store and the monitors (the cluster alive)


def test_the_key_value_store_overwrites_lists_and_deletes(stall_cluster):
    for rank, seen in enumerate(stall_cluster["seen"]):
        kv = seen["kv"]
        assert kv["own"] == "second"  # set twice: overwritten
        assert kv["missing"] is None
        assert kv["peer"] == "second"  # the other process's key
        assert kv["listed"] == [
            ("keras_mgpu_test/0/a", "second"),
            ("keras_mgpu_test/1/a", "second"),
        ]
        assert kv["after_delete"] == []  # folders deleted, none left
        assert seen["worker_info"]["rank"] == rank


def test_straggler_monitor_logs_every_process_on_every_process(stall_cluster):
    first, second = (seen["fit"] for seen in stall_cluster["seen"])
    names = ("step_ms", "wait_ms", "busy_ms")
    expected = [f"workers/w{w}_{n}" for w in (0, 1) for n in names] + [
        "workers/step_time_ratio",
        "workers/slowest",
    ]
    for fit in (first, second):
        assert fit["straggler_keys"] == expected
        assert set(expected) <= set(fit["history"])
        assert all(len(fit["history"][k]) == bodies.EPOCHS for k in expected)
    # Gathered: both processes log the same figures, exactly.
    for key in expected:
        assert first["history"][key] == second["history"][key], key


def test_the_process_slow_between_steps_is_named_the_straggler(stall_cluster):
    history = stall_cluster["seen"][0]["fit"]["history"]
    slow_ms = 1000.0 * bodies.SLOW
    for epoch in range(bodies.EPOCHS):
        assert history["workers/slowest"][epoch] == 1.0
        assert history["workers/step_time_ratio"][epoch] > 1.25
        # Process 0 waited for process 1's callback in every step; process
        # 1 spent least time in the step (wait 0 by definition).
        assert history["workers/w1_wait_ms"][epoch] == 0.0
        assert history["workers/w0_wait_ms"][epoch] > 0.6 * slow_ms
        for w in (0, 1):
            assert history[f"workers/w{w}_busy_ms"][epoch] == pytest.approx(
                history[f"workers/w{w}_step_ms"][epoch]
                - history[f"workers/w{w}_wait_ms"][epoch]
            )
    for seen in stall_cluster["seen"]:
        warned = [w for w in seen["fit"]["warnings"] if "straggler" in w]
        assert len(warned) == 1, seen["fit"]["warnings"]  # once per fit
        assert warned[0].startswith(
            "StragglerMonitor: process 1 is a straggler"
        )
        # The timing wrapper went with the fit.
        assert seen["fit"]["train_function_restored"]


def test_memory_monitor_gathers_every_process_figures(stall_cluster):
    first, second = (seen["fit"] for seen in stall_cluster["seen"])
    host = ("host_rss_mb", "host_system_used_mb", "host_system_available_mb")
    expected = [f"mem/w{w}_{n}" for w in (0, 1) for n in host]
    for fit in (first, second):
        assert fit["memory_keys"] == expected
        # Each process's own psutil figures (100 + rank MB resident),
        # exchanged exactly.
        assert fit["history"]["mem/w0_host_rss_mb"] == [100.0] * bodies.EPOCHS
        assert fit["history"]["mem/w1_host_rss_mb"] == [101.0] * bodies.EPOCHS
        assert fit["history"]["mem/w1_host_system_available_mb"] == (
            [6001.0] * bodies.EPOCHS
        )


def test_gpu_load_monitor_gathers_too(stall_cluster):
    for seen in stall_cluster["seen"]:
        keys = set(seen["fit"]["history"])
        for w in (0, 1):
            assert f"cpu/w{w}_util_mean_pct" in keys
            assert f"cpu/w{w}_samples" in keys


def test_throughput_monitor_counts_every_process_devices(stall_cluster):
    # Dense 3 -> 4 -> 1: forward 2*3*4 + 4 + 2*4*1 + 1 = 37 FLOPs a sample,
    # model FLOPs 3 x that; the global batch of 8 per step; 4 devices.
    for rank, seen in enumerate(stall_cluster["seen"]):
        figures = {
            k.split("/")[1].split("_", 1)[1]: v
            for k, v in seen["fit"]["throughput"].items()
        }
        assert all(
            k.startswith(f"perf/w{rank}_") for k in seen["fit"]["throughput"]
        )
        assert figures["flops_per_sample"] == pytest.approx(111.0, rel=0.05)
        assert figures["samples_per_sec"] == pytest.approx(
            figures["batches_per_sec"] * bodies.BATCH
        )
        assert figures["tflops_per_device"] == pytest.approx(
            figures["flops_per_sample"] * figures["samples_per_sec"] / 4 / 1e12
        )


def test_a_healthy_watched_fit_is_not_aborted_and_leaves_no_status(
    stall_cluster,
):
    for seen in stall_cluster["seen"]:
        assert seen["fit"]["watchdog_report"] is None
        assert seen["fit"]["statuses_left"] == []


# ---------------------------------------------------------------------------
# A stalled process


def test_a_process_stalled_in_a_callback_is_named_within_the_timeout(
    stall_cluster,
):
    waiter, stalled = stall_cluster["runs"]
    out = stall_cluster["out"]
    assert waiter["returncode"] == EXIT_CODE, waiter["output"][-3000:]
    text = waiter["output"]
    # Process 0 waits in step 3 or a later one: with Keras's asynchronous
    # callback dispatch (kept on by every callback of ours) its host
    # dispatches the next steps before step 3's all-reduce, which needs the
    # stalled process, completes; how far it runs ahead is a race.
    waited_in = re.search(r"waited \d+ s in train step (\d+) for", text)
    assert waited_in and int(waited_in.group(1)) >= 3, text[-3000:]
    assert re.search(
        r"keras_mgpu WorkerWatchdog: process:0 \(.+, pid \d+\) waited \d+ s "
        r"in train step \d+ for missing worker\(s\): process:1 \(.+, pid \d+\)"
        r": stalled in Python for \d+ s at .*jax_monitor_bodies\.py:\d+ in "
        r"on_train_batch_begin \(after train step 2\)\. Restart every "
        r"worker of the job",
        text,
    ), text[-3000:]
    assert f"This process exits with status {EXIT_CODE}" in text
    assert text.count("keras_mgpu WorkerWatchdog:") == 1
    waited = waiter["ended_at"] - _moment(out, "waiting_since")
    assert bodies.STALL_TIMEOUT - 1.0 <= waited < bodies.STALL_TIMEOUT + MARGIN
    # The stalled process ends too (JAX ends it once process 0, which hosts
    # the coordination service, is gone), long before its stall is over;
    # no fit returned.
    assert stalled["returncode"] not in (None, 0)
    assert stalled["ended_at"] - waiter["ended_at"] < MARGIN
    assert not [n for n in os.listdir(out) if n.startswith("stall_fit_ret")]


# ---------------------------------------------------------------------------
# A lost process


def test_a_frozen_process_is_named_when_its_heartbeat_stops(freeze_cluster):
    survivor, frozen = freeze_cluster["runs"]
    assert frozen["returncode"] is None  # stopped, never ended by itself
    assert survivor["returncode"] == EXIT_CODE, survivor["output"][-3000:]
    text = survivor["output"]
    assert re.search(
        # Step 3 or later: asynchronous dispatch (see the stalled case).
        r"process:0 \(.+\) waited \d+ s in train step (?:[3-9]|\d\d+) for "
        r"missing "
        r"worker\(s\): process:1 \(.+, pid \d+\): no heartbeat for \d+ s "
        r"\(process killed, crashed or frozen\)",
        text,
    ), text[-3000:]
    after = survivor["ended_at"] - _moment(freeze_cluster["out"], "killed_at")
    assert STALE_AFTER - 1.0 <= after < STALE_AFTER + MARGIN


def test_a_killed_process_ends_the_run_within_the_bound(kill_cluster):
    """The property, not which detector wins: gloo's TCP transport may end
    the survivor at once (SIGABRT, measured: "gloo::EnforceNotMet ...
    Received data size doesn't match"), JAX's heartbeat after
    `heartbeat_timeout`, the watchdog after `stale_after` (status 75,
    naming process:1); every one within the watchdog's bound, with a
    message."""
    survivor, killed = kill_cluster["runs"]
    assert killed["returncode"] == -9
    assert survivor["returncode"] is not None, "the survivor hung"
    after = survivor["ended_at"] - _moment(kill_cluster["out"], "killed_at")
    assert after < STALE_AFTER + MARGIN
    text = survivor["output"]
    if survivor["returncode"] == EXIT_CODE:
        assert "process:1 (" in text and "no heartbeat" in text, text[-3000:]
    else:  # SIGABRT from gloo or JAX (or an error they raised)
        assert survivor["returncode"] != 0, text[-3000:]
        assert "gloo" in text or "unhealthy" in text, text[-3000:]
    assert not [
        n for n in os.listdir(kill_cluster["out"]) if "fit_returned" in n
    ]

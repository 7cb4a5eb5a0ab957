"""Aggregation math, the sampling thread and the host backend."""

from __future__ import annotations

import math
import sys
import threading
import time

import pytest
from monitoring._monitor_fakes import FakePsutil

from keras_mgpu.monitoring import HostBackend, Sampler
from keras_mgpu.monitoring.aggregate import Aggregator, spread
from keras_mgpu.monitoring.log_keys import make_key, worker_prefix
from keras_mgpu.monitoring.sampler import live_sampler_threads

NAN = float("nan")


def test_aggregator_spread_and_log_keys():
    agg = Aggregator()
    for value in (1.0, 3.0, NAN, 8.0):
        agg.add({"a": value, "b": NAN})
    stats = agg.collect()
    assert stats["a"].mean == pytest.approx(4.0)
    assert (stats["a"].max, stats["a"].min, stats["a"].count) == (8.0, 1.0, 3)
    assert math.isnan(stats["b"].mean) and stats["b"].count == 0
    assert agg.samples == 0 and agg.collect() == {}
    assert agg.latest()["a"] == 8.0
    assert spread([10.0, 70.0, NAN, 40.0]) == 60.0
    assert spread([5.0]) == 0.0
    assert math.isnan(spread([NAN]))
    assert make_key("mem", "gpu0_peak_mb") == "mem/gpu0_peak_mb"
    assert make_key("gpu", "gpu0_util_mean_pct", "w1_") == (
        "gpu/w1_gpu0_util_mean_pct"
    )
    with pytest.raises(ValueError, match="Invalid monitor log key"):
        make_key("mem", "GPU:0 peak")
    assert worker_prefix(None) == ""
    assert worker_prefix(True) == "w0_"


def test_sampler_samples_aggregates_and_stops():
    calls = []

    def sample():
        calls.append(threading.current_thread().name)
        return {"x": float(len(calls))}

    stopped = []
    sampler = Sampler(sample, 0.005, on_stop=lambda: stopped.append(1))
    sampler.start()
    sampler.start()  # idempotent: restarts, never two threads
    assert len(live_sampler_threads()) == 1
    time.sleep(0.06)
    stats = sampler.collect()["x"]
    assert stats.count >= 3 and stats.max >= stats.mean >= stats.min
    sampler.stop()
    sampler.stop()
    assert not sampler.running and live_sampler_threads() == []
    # Readings came from the sampling thread, never the caller's.
    assert all(name.startswith("keras_mgpu-sampler") for name in calls)
    assert stopped == [1, 1]  # once per start


def test_sampler_error_is_kept_and_never_raised():
    def sample():
        raise RuntimeError("driver gone")

    sampler = Sampler(sample, 0.001)
    sampler.start()
    time.sleep(0.03)
    assert not sampler.running
    assert "driver gone" in str(sampler.error)
    sampler.sample_now()  # does not raise either
    sampler.stop()


def test_sampler_stops_when_the_watched_frame_returns():
    sampler = Sampler(lambda: {"x": 1.0}, 10.0)

    def training_loop():
        sampler.start(watch_frame=sys._getframe())
        assert sampler.running
        raise KeyboardInterrupt  # the loop ends without any stop call

    with pytest.raises(KeyboardInterrupt):
        training_loop()
    deadline = time.monotonic() + 2.0
    while sampler.running and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not sampler.running


def test_sampler_rejects_bad_interval():
    with pytest.raises(ValueError, match="Argument `interval` must be"):
        Sampler(dict, 0)


def test_host_backend_with_fake_psutil():
    backend = HostBackend(psutil_module=FakePsutil(cores=(10.0, 90.0)))
    backend.open()
    assert backend.devices == ["core0", "core1"]
    assert backend.sample() == {
        "core0_util": 10.0,
        "core1_util": 90.0,
        "util": 50.0,
    }
    memory = backend.memory()
    assert memory == {
        "rss_mb": 500.0,
        "system_used_mb": 2000.0,
        "system_available_mb": 6000.0,
        "system_total_mb": 8000.0,
    }
    backend.close()


def test_host_backend_real_psutil():
    backend = HostBackend()
    backend.open()
    sample = backend.sample()
    assert len(backend.devices) >= 1
    assert 0.0 <= sample["util"] <= 100.0
    assert backend.memory()["rss_mb"] > 10.0
    backend.close()

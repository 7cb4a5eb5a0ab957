"""MemoryMonitor: fake allocator figures, real runs on every strategy."""

from __future__ import annotations

import csv
import math

import pytest
from _training import mlp, regression_data
from monitoring._monitor_cases import MEMORY_MONITOR_BAD_INPUT
from monitoring._monitor_fakes import FakePsutil, FakeTFMemory

from keras_mgpu._flavour import keras
from keras_mgpu.callbacks import GPULoadMonitor, MemoryMonitor
from keras_mgpu.callbacks import memory_monitor as memory_monitor_module
from keras_mgpu.monitoring import (
    HostBackend,
    MonitorWarning,
    notices,
)
from keras_mgpu.monitoring.sampler import live_sampler_threads

HOST_KEYS = {
    "mem/host_rss_mb",
    "mem/host_system_used_mb",
    "mem/host_system_available_mb",
}


class Allocate(keras.callbacks.Callback):
    """Stands for the training step's allocations: raises fake peaks."""

    def __init__(self, fake, peaks):
        super().__init__()
        self.fake, self.peaks = fake, peaks

    def on_train_batch_end(self, batch, logs=None):
        for device, peak in self.peaks.items():
            self.fake.devices[device][1] = peak


def compiled_model():
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


@pytest.fixture
def fake_gpu_strategy(monkeypatch):
    """Pretend the strategy runs on GPU:0 and GPU:1 (and CPU:0)."""
    monkeypatch.setattr(
        memory_monitor_module,
        "strategy_devices",
        lambda strategy, variables=(): ["GPU:0", "GPU:1", "CPU:0"],
    )
    monkeypatch.setattr(notices, "_PROCESS_NOTES", set())


def with_sources(monitor, **sources):
    """Replace the monitor's readers with stand-ins (private attributes:
    test seams are not part of the public signature)."""
    for name, value in sources.items():
        setattr(monitor, f"_{name}", value)
    return monitor


def test_per_device_peaks_capacity_warning_and_csv(fake_gpu_strategy, tmp_path):
    fake = FakeTFMemory(
        {"GPU:0": (1000, 15000), "GPU:1": (500, 2000), "CPU:0": (40, 60)},
        capacity={"GPU:0": 16000.0},
    )
    monitor = with_sources(
        MemoryMonitor(),
        reader=fake.reader(),
        host_backend=HostBackend(psutil_module=FakePsutil(rss_mb=700)),
    )
    x, y = regression_data(32)
    csv_path = tmp_path / "log.csv"
    with pytest.warns(MonitorWarning) as record:
        history = compiled_model().fit(
            x,
            y,
            epochs=2,
            batch_size=16,
            verbose=0,
            callbacks=[
                Allocate(fake, {"GPU:0": 15000, "GPU:1": 2000}),
                monitor,
                keras.callbacks.CSVLogger(str(csv_path)),
            ],
        )
    messages = [str(w.message) for w in record]
    pressure = [m for m in messages if "reached" in m]
    assert len(pressure) == 1  # once per device per run
    assert (
        "GPU:0 reached 94% of its 16000 MB capacity in epoch 0" in (pressure[0])
    )
    for remedy in (
        "GradientAccumulationOptimizer",
        "apply_recompute",
        "smaller per-replica batch",
    ):
        assert remedy in pressure[0]
    assert sum("process-wide" in m for m in messages) == 1

    expected = {
        "mem/gpu0_current_mb",
        "mem/gpu0_peak_mb",
        "mem/gpu0_peak_frac",  # capacity known for gpu0 only
        "mem/gpu1_current_mb",
        "mem/gpu1_peak_mb",
        "mem/host_tf_current_mb",
        "mem/host_tf_peak_mb",
    } | HOST_KEYS
    assert set(monitor.keys) == expected
    h = history.history
    assert h["mem/gpu0_current_mb"] == [1000.0, 1000.0]
    assert h["mem/gpu0_peak_mb"] == [15000.0, 15000.0]
    # The peak is reset at every epoch begin.
    assert fake.resets.count("GPU:0") == 3  # train begin + 2 epochs
    assert "CPU:1" not in fake.resets  # CPU figures: once, as host
    assert h["mem/gpu0_peak_frac"][0] == pytest.approx(15000 / 16000)
    assert h["mem/host_tf_current_mb"] == [40.0, 40.0]
    assert h["mem/host_rss_mb"] == [700.0, 700.0]
    assert h["mem/host_system_available_mb"][0] == 6000.0
    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert expected <= set(rows[0]) and len(rows) == 2


def test_cpu_without_allocator_stats_and_capacity_override(fake_gpu_strategy):
    fake = FakeTFMemory({"GPU:0": (100, 950), "GPU:1": (100, 200)})
    monitor = with_sources(
        MemoryMonitor(capacity_mb={"gpu0": 1000}, host=False),
        reader=fake.reader(),
    )
    x, y = regression_data(16)
    with pytest.warns(MonitorWarning) as record:
        history = compiled_model().fit(
            x,
            y,
            batch_size=16,
            verbose=0,
            callbacks=[Allocate(fake, {"GPU:0": 950}), monitor],
        )
    messages = [str(w.message) for w in record]
    assert any("statistics are not available" in m for m in messages)
    assert any("GPU:0 reached 95%" in m for m in messages)
    assert set(monitor.keys) == {
        "mem/gpu0_current_mb",
        "mem/gpu0_peak_mb",
        "mem/gpu0_peak_frac",
        "mem/gpu1_current_mb",
        "mem/gpu1_peak_mb",
    }
    assert history.history["mem/gpu0_peak_frac"] == [0.95]
    no_warning = MemoryMonitor(warn_fraction=None, capacity_mb=10.0)
    no_warning._check_pressure("GPU:0", 10.0, 10.0, 0)  # silent


def test_batch_logging_is_opt_in(fake_gpu_strategy):
    assert "on_train_batch_end" not in vars(MemoryMonitor())
    fake = FakeTFMemory({"GPU:0": (123, 200), "GPU:1": (5, 6)})
    monitor = with_sources(
        MemoryMonitor(update_freq=1, host=False), reader=fake.reader()
    )
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(logs.get("mem/gpu0_current_mb"))

    x, y = regression_data(32)
    with pytest.warns(MonitorWarning):
        compiled_model().fit(
            x, y, batch_size=16, verbose=0, callbacks=[monitor, Record()]
        )
    assert seen == [123.0, 123.0]


@pytest.mark.parametrize("kwargs, error, match", MEMORY_MONITOR_BAD_INPUT)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        MemoryMonitor(**kwargs)


def test_deprecated_name_warns_at_the_users_line():
    with pytest.warns(FutureWarning, match="`log_every_n_batches` is dep") as w:
        assert MemoryMonitor(log_every_n_batches=3).update_freq == 3
    assert w[0].filename == __file__  # the user's line, not ours


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_both_monitors_train_under_every_strategy(strategy, strategy_name):
    x, y = regression_data(32)
    with strategy.scope():
        model = compiled_model()
    memory = MemoryMonitor()
    load = GPULoadMonitor(interval=0.01)
    history = model.fit(
        x, y, epochs=2, batch_size=16, verbose=0, callbacks=[memory, load]
    )
    h = history.history
    assert set(memory.keys) >= HOST_KEYS
    assert not any(k.startswith("mem/cpu") for k in memory.keys)
    assert load.mode == "cpu"  # no GPU here: psutil fallback
    for key in memory.keys + load.keys:
        assert len(h[key]) == 2, (strategy_name, key)
    assert h["mem/host_rss_mb"][0] > 10
    assert 0 <= h["cpu/util_mean_pct"][1] <= 100
    assert not math.isnan(h["cpu/util_spread_pct"][1])
    assert live_sampler_threads() == []


@pytest.mark.slow
def test_multi_worker_keys_carry_the_worker_prefix():
    from _processes import run_workers

    results = run_workers(
        "monitoring._mw_monitor_bodies:monitor_body",
        num_workers=2,
        timeout=240,
        env={"TF_ENABLE_ONEDNN_OPTS": "1"},
    )
    for task, result in enumerate(results):
        logs = result["logs"]
        assert f"mem/w{task}_host_rss_mb" in logs
        assert f"cpu/w{task}_util_mean_pct" in logs
        # oneDNN on: TensorFlow's process-wide CPU figures, once.
        assert logs[f"mem/w{task}_host_tf_peak_mb"] >= 0
        assert not any(
            k.startswith(("mem/", "cpu/")) and f"w{task}_" not in k
            for k in logs
        )
        assert sorted(result["keys"]) == sorted(logs)


@pytest.mark.slow
def test_multi_worker_gather_puts_every_workers_figures_on_each():
    from _processes import run_workers

    results = run_workers(
        "monitoring._mw_monitor_bodies:monitor_body",
        num_workers=2,
        timeout=240,
        args=(True,),
    )
    logs = [result["logs"] for result in results]
    # Both workers log both workers' keys, the chief included ...
    assert sorted(logs[0]) == sorted(logs[1]) == sorted(results[0]["keys"])
    for task in (0, 1):
        assert f"mem/w{task}_host_rss_mb" in logs[0]
        assert f"cpu/w{task}_util_mean_pct" in logs[0]
    # ... with the same values: each cell came from its owner.
    for key in logs[0]:
        a, b = logs[0][key], logs[1][key]
        assert a == b or (math.isnan(a) and math.isnan(b)), key
    # Two processes, two different resident sizes.
    assert logs[0]["mem/w0_host_rss_mb"] != logs[0]["mem/w1_host_rss_mb"]

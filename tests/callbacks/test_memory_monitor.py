"""MemoryMonitor on both backends: fake allocator figures (TensorFlow's
memory info, JAX's `memory_stats()`), real runs on every strategy, and on
JAX the preallocation note (once) and no TensorFlow import."""

from __future__ import annotations

import csv
import math
import sys
import warnings

import pytest
from _training import mlp, regression_data
from monitoring._jax_fakes import FakeMemoryStats, fake_device
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

pytestmark = pytest.mark.backends("tensorflow", "jax")

JAX = keras.backend.backend() == "jax"
TF_ONLY = pytest.mark.backends("tensorflow")
JAX_ONLY = pytest.mark.backends("jax")

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


@pytest.fixture(autouse=True)
def _no_tensorflow_and_fresh_notes(monkeypatch):
    if JAX:
        # Nothing here may import TensorFlow on JAX: an import now fails.
        monkeypatch.setitem(sys.modules, "tensorflow", None)
        monkeypatch.setattr(notices, "_PROCESS_NOTES", set())


@pytest.fixture
def preallocating(monkeypatch):
    """JAX's default GPU allocator: preallocation on."""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)


def fake_gpus(monkeypatch, fake):
    """Pretend the distribution runs on the fake's GPUs (and CPU 0)."""
    monkeypatch.setattr(
        memory_monitor_module,
        "distribution_devices",
        lambda distribution=None, variables=(): [
            *fake.gpus(),
            fake_device("cpu", 0),
        ],
    )


def with_jax_sources(monitor, memory_stats=None, psutil=None):
    """Stand-ins for the monitor's readers (private test seams)."""
    from keras_mgpu.backend.jax.memory import JAXMemoryReader

    if memory_stats is not None:
        monitor._reader = JAXMemoryReader(memory_stats)
    monitor._host_backend = HostBackend(psutil_module=psutil or FakePsutil())
    return monitor


def fit_jax(monitor, *callbacks, epochs=2, distribution=None):
    x, y = regression_data(32)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model.fit(
        x,
        y,
        epochs=epochs,
        batch_size=16,
        verbose=0,
        callbacks=[*callbacks, monitor],
    )


def messages(record, text):
    return [str(w.message) for w in record if text in str(w.message)]


@TF_ONLY
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


@TF_ONLY
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


@TF_ONLY
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


@TF_ONLY
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


@TF_ONLY
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


@TF_ONLY
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


@JAX_ONLY
def test_gpu_figures_keys_and_pressure_as_on_tensorflow(
    monkeypatch, preallocating
):
    """The situation of TensorFlow's test_per_device_peaks_capacity_...:
    GPU:0 with a known capacity, GPU:1 without, host figures on. The keys
    are TensorFlow's, less its `mem/host_tf_*` (JAX keeps no CPU
    statistics)."""
    fake = FakeMemoryStats({0: (1000, 1000, 16000), 1: (500, 2000, None)})
    fake_gpus(monkeypatch, fake)
    monitor = with_jax_sources(
        MemoryMonitor(), fake, FakePsutil(rss_mb=700, available_mb=6000)
    )
    with pytest.warns(MonitorWarning) as record:
        history = fit_jax(monitor, Allocate(fake, {0: 15000}))
    assert (
        set(monitor.keys)
        == {
            "mem/gpu0_current_mb",
            "mem/gpu0_peak_mb",
            "mem/gpu0_peak_frac",  # capacity known for gpu0 only
            "mem/gpu1_current_mb",
            "mem/gpu1_peak_mb",
        }
        | HOST_KEYS
    )
    h = history.history
    assert h["mem/gpu0_current_mb"] == [1000.0, 1000.0]
    assert h["mem/gpu0_peak_mb"] == [15000.0, 15000.0]
    assert h["mem/gpu1_peak_mb"] == [2000.0, 2000.0]
    assert h["mem/gpu0_peak_frac"][0] == pytest.approx(15000 / 16000)
    assert h["mem/host_rss_mb"] == [700.0, 700.0]
    assert h["mem/host_system_available_mb"][0] == 6000.0
    pressure = messages(record, "reached")
    assert len(pressure) == 1  # once per device per run
    assert (
        "GPU:0 reached 94% of its 16000 MB capacity in epoch 0" in (pressure[0])
    )
    assert len(messages(record, "no memory statistics for CPU")) == 1
    # The preallocation note: once, saying how to turn it off.
    (note,) = messages(record, "preallocates")
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in note
    assert "XLA_PYTHON_CLIENT_ALLOCATOR=platform" in note


@JAX_ONLY
def test_preallocation_note_exactly_once_per_process(
    monkeypatch, preallocating
):
    fake = FakeMemoryStats({0: (10, 20, 1000)})
    fake_gpus(monkeypatch, fake)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit_jax(with_jax_sources(MemoryMonitor(), fake), epochs=1)
        fit_jax(with_jax_sources(MemoryMonitor(update_freq=1), fake), epochs=1)
    assert len(messages(record, "preallocates")) == 1


@JAX_ONLY
@pytest.mark.parametrize(
    "name, value",
    [
        ("XLA_PYTHON_CLIENT_PREALLOCATE", "false"),
        ("XLA_PYTHON_CLIENT_ALLOCATOR", "platform"),
    ],
)
def test_no_preallocation_note_when_it_is_off(
    monkeypatch, preallocating, name, value
):
    monkeypatch.setenv(name, value)
    fake = FakeMemoryStats({0: (10, 20, 1000)})
    fake_gpus(monkeypatch, fake)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit_jax(with_jax_sources(MemoryMonitor(), fake), epochs=1)
    assert messages(record, "preallocates") == []


@JAX_ONLY
def test_capacity_override_and_no_stats_as_on_tensorflow(
    monkeypatch, preallocating
):
    """The situation of TensorFlow's test_cpu_without_allocator_stats_...:
    the same keys; a GPU that reports no statistics is left out."""
    fake = FakeMemoryStats({0: (100, 950, None), 1: (100, 200, None)})
    devices = [*fake.gpus(), fake_device("gpu", 2), fake_device("cpu", 0)]
    monkeypatch.setattr(
        memory_monitor_module,
        "distribution_devices",
        lambda distribution=None, variables=(): devices,
    )
    monitor = with_jax_sources(
        MemoryMonitor(capacity_mb={"gpu0": 1000}, host=False), fake
    )
    with pytest.warns(MonitorWarning) as record:
        history = fit_jax(monitor, epochs=1)
    assert set(monitor.keys) == {
        "mem/gpu0_current_mb",
        "mem/gpu0_peak_mb",
        "mem/gpu0_peak_frac",
        "mem/gpu1_current_mb",
        "mem/gpu1_peak_mb",
    }
    assert history.history["mem/gpu0_peak_frac"] == [0.95]
    assert messages(record, "GPU:0 reached 95%")
    assert messages(record, "no memory statistics (memory_stats()) for GPU:2")


@JAX_ONLY
def test_batch_logging_reads_the_fake_device(monkeypatch, preallocating):
    fake = FakeMemoryStats({0: (123, 200, None)})
    fake_gpus(monkeypatch, fake)
    monitor = with_jax_sources(MemoryMonitor(update_freq=1, host=False), fake)
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(logs.get("mem/gpu0_current_mb"))

    x, y = regression_data(32)
    model = mlp()
    model.compile(optimizer="sgd", loss="mse")
    with pytest.warns(MonitorWarning):
        model.fit(x, y, batch_size=16, verbose=0, callbacks=[monitor, Record()])
    assert seen == [123.0, 123.0]


@JAX_ONLY
@pytest.mark.parametrize("gather_workers", [False, True])
def test_cpu_devices_of_a_data_parallel_fit_log_host_figures(gather_workers):
    """Real CPU devices (memory_stats() is None): only the psutil host
    figures, TensorFlow's keys for CPU without allocator statistics; one
    JAX process gathers nothing with gather_workers=True."""
    devices = keras.distribution.list_devices("cpu")
    distribution = keras.distribution.DataParallel(devices=devices)
    monitor = with_jax_sources(
        MemoryMonitor(gather_workers=gather_workers), psutil=FakePsutil()
    )
    with distribution.scope():
        with pytest.warns(MonitorWarning, match="no memory statistics"):
            history = fit_jax(monitor)
    # The distribution's 4 CPU devices were read, none logged per device.
    assert sorted(monitor._reader._devices) == [f"CPU:{i}" for i in range(4)]
    assert monitor._devices == []
    assert set(monitor.keys) == HOST_KEYS
    assert history.history["mem/host_rss_mb"] == [500.0, 500.0]


@JAX_ONLY
def test_gather_workers_on_several_jax_processes_logs_every_process(
    monkeypatch,
):
    """Several JAX processes (faked: process 0 of 2, the other process's
    row being twice ours): every process's figures under its `w<k>_`
    prefix, exchanged by `process_allgather` (the 2-process run is in
    tests/distribute/test_jax_monitors_jax.py)."""
    import numpy as np

    from keras_mgpu import distribute
    from keras_mgpu.backend.jax import processes
    from keras_mgpu.monitoring import log_keys

    two = {
        "task_type": "process",
        "task_id": 0,
        "rank": 0,
        "num_workers": 2,
        "is_chief": True,
        "task_name": "process:0",
    }
    monkeypatch.setattr(distribute, "worker_info", lambda strategy=None: two)
    monkeypatch.setattr(log_keys, "worker_info", lambda strategy=None: two)
    exchanged = []

    def allgather_rows(row):
        exchanged.append(row.size)
        other = row if len(exchanged) % 2 else 2 * row  # header, figures
        return np.stack([row, other])

    monkeypatch.setattr(processes, "allgather_rows", allgather_rows)
    monitor = with_jax_sources(
        MemoryMonitor(gather_workers=True), psutil=FakePsutil()
    )
    with pytest.warns(MonitorWarning, match="no memory statistics"):
        history = fit_jax(monitor)
    assert set(monitor.keys) == {
        key.replace("mem/", f"mem/w{w}_") for key in HOST_KEYS for w in (0, 1)
    }
    assert history.history["mem/w0_host_rss_mb"] == [500.0, 500.0]
    assert history.history["mem/w1_host_rss_mb"] == [1000.0, 1000.0]
    assert exchanged == [2, 3, 2, 3]  # header, then figures, per epoch

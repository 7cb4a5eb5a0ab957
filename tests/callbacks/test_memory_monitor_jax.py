"""MemoryMonitor on Keras's JAX backend: fake `memory_stats()` for GPU
figures, host figures on CPU devices, TensorFlow's log keys, the
preallocation note (once), and no TensorFlow import."""

from __future__ import annotations

import sys
import warnings

import keras
import pytest
from _training import mlp, regression_data
from monitoring._jax_fakes import FakeMemoryStats, fake_device
from monitoring._monitor_cases import MEMORY_MONITOR_BAD_INPUT
from monitoring._monitor_fakes import FakePsutil

from keras_mgpu.backend.jax.memory import JAXMemoryReader
from keras_mgpu.callbacks import MemoryMonitor
from keras_mgpu.callbacks import memory_monitor as memory_monitor_module
from keras_mgpu.monitoring import HostBackend, MonitorWarning, notices

HOST_KEYS = {
    "mem/host_rss_mb",
    "mem/host_system_used_mb",
    "mem/host_system_available_mb",
}


@pytest.fixture(autouse=True)
def _no_tensorflow_and_fresh_notes(monkeypatch):
    # Nothing here may import TensorFlow: an import now fails.
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


def with_sources(monitor, memory_stats=None, psutil=None):
    """Stand-ins for the monitor's readers (private test seams)."""
    if memory_stats is not None:
        monitor._reader = JAXMemoryReader(memory_stats)
    monitor._host_backend = HostBackend(psutil_module=psutil or FakePsutil())
    return monitor


class Allocate(keras.callbacks.Callback):
    """Stands for the training step's allocations: raises fake peaks."""

    def __init__(self, fake, peaks):
        super().__init__()
        self.fake, self.peaks = fake, peaks

    def on_train_batch_end(self, batch, logs=None):
        for index, peak in self.peaks.items():
            self.fake.devices[index][1] = peak


def fit(monitor, *callbacks, epochs=2, distribution=None):
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


def test_gpu_figures_keys_and_pressure_as_on_tensorflow(
    monkeypatch, preallocating
):
    """The situation of TensorFlow's test_per_device_peaks_capacity_...:
    GPU:0 with a known capacity, GPU:1 without, host figures on. The keys
    are TensorFlow's, less its `mem/host_tf_*` (JAX keeps no CPU
    statistics)."""
    fake = FakeMemoryStats({0: (1000, 1000, 16000), 1: (500, 2000, None)})
    fake_gpus(monkeypatch, fake)
    monitor = with_sources(
        MemoryMonitor(), fake, FakePsutil(rss_mb=700, available_mb=6000)
    )
    with pytest.warns(MonitorWarning) as record:
        history = fit(monitor, Allocate(fake, {0: 15000}))
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


def test_preallocation_note_exactly_once_per_process(
    monkeypatch, preallocating
):
    fake = FakeMemoryStats({0: (10, 20, 1000)})
    fake_gpus(monkeypatch, fake)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        fit(with_sources(MemoryMonitor(), fake), epochs=1)
        fit(with_sources(MemoryMonitor(update_freq=1), fake), epochs=1)
    assert len(messages(record, "preallocates")) == 1


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
        fit(with_sources(MemoryMonitor(), fake), epochs=1)
    assert messages(record, "preallocates") == []


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
    monitor = with_sources(
        MemoryMonitor(capacity_mb={"gpu0": 1000}, host=False), fake
    )
    with pytest.warns(MonitorWarning) as record:
        history = fit(monitor, epochs=1)
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


def test_batch_logging_reads_the_fake_device(monkeypatch, preallocating):
    fake = FakeMemoryStats({0: (123, 200, None)})
    fake_gpus(monkeypatch, fake)
    monitor = with_sources(MemoryMonitor(update_freq=1, host=False), fake)
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


@pytest.mark.parametrize("gather_workers", [False, True])
def test_cpu_devices_of_a_data_parallel_fit_log_host_figures(gather_workers):
    """Real CPU devices (memory_stats() is None): only the psutil host
    figures, TensorFlow's keys for CPU without allocator statistics; one
    JAX process gathers nothing with gather_workers=True."""
    devices = keras.distribution.list_devices("cpu")
    distribution = keras.distribution.DataParallel(devices=devices)
    monitor = with_sources(
        MemoryMonitor(gather_workers=gather_workers), psutil=FakePsutil()
    )
    with distribution.scope():
        with pytest.warns(MonitorWarning, match="no memory statistics"):
            history = fit(monitor)
    # The distribution's 4 CPU devices were read, none logged per device.
    assert sorted(monitor._reader._devices) == [f"CPU:{i}" for i in range(4)]
    assert monitor._devices == []
    assert set(monitor.keys) == HOST_KEYS
    assert history.history["mem/host_rss_mb"] == [500.0, 500.0]


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
    monitor = with_sources(
        MemoryMonitor(gather_workers=True), psutil=FakePsutil()
    )
    with pytest.warns(MonitorWarning, match="no memory statistics"):
        history = fit(monitor)
    assert set(monitor.keys) == {
        key.replace("mem/", f"mem/w{w}_") for key in HOST_KEYS for w in (0, 1)
    }
    assert history.history["mem/w0_host_rss_mb"] == [500.0, 500.0]
    assert history.history["mem/w1_host_rss_mb"] == [1000.0, 1000.0]
    assert exchanged == [2, 3, 2, 3]  # header, then figures, per epoch


@pytest.mark.parametrize("kwargs, error, match", MEMORY_MONITOR_BAD_INPUT)
def test_bad_input_as_on_tensorflow(kwargs, error, match):
    with pytest.raises(error, match=match):
        MemoryMonitor(**kwargs)

"""GPULoadMonitor on Keras's JAX backend: a fake NVML, the distribution's
GPUs chosen by CUDA ordinal, the psutil fallback on CPU, no TensorFlow."""

from __future__ import annotations

import functools
import sys
import warnings

import keras
import pytest
from _training import mlp, regression_data
from monitoring._jax_fakes import fake_device
from monitoring._monitor_cases import GPU_FIGURES, GPU_LOAD_MONITOR_BAD_INPUT
from monitoring._monitor_fakes import FakeNvml, FakePsutil, gpu

from keras_mgpu.backend.jax import devices as jax_devices
from keras_mgpu.callbacks import GPULoadMonitor
from keras_mgpu.callbacks import gpu_load_monitor as gpu_load_monitor_module
from keras_mgpu.monitoring import (
    HostBackend,
    MonitorWarning,
    NvmlBackend,
    notices,
)
from keras_mgpu.monitoring.sampler import live_sampler_threads


@pytest.fixture(autouse=True)
def _no_tensorflow_and_fresh_notes(monkeypatch):
    # Nothing here may import TensorFlow: an import now fails.
    monkeypatch.setitem(sys.modules, "tensorflow", None)
    monkeypatch.setattr(notices, "_PROCESS_NOTES", set())
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)


def fit(monitor, epochs=2):
    x, y = regression_data(32)
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model.fit(
        x, y, epochs=epochs, batch_size=16, verbose=0, callbacks=[monitor]
    )


def test_fake_nvml_figures_with_tensorflows_keys():
    nvml = FakeNvml(
        [
            gpu("GPU-a", util=20, used_mb=15000, total_mb=16000),
            gpu("GPU-b", util=90, used_mb=4000, total_mb=16000),
        ]
    )
    monitor = GPULoadMonitor(interval=0.002)
    monitor._backend_arg = NvmlBackend(nvml=nvml, environ={})
    with pytest.warns(MonitorWarning, match="input pipeline"):
        history = fit(monitor)
    expected = {f"gpu/gpu{i}_{f}" for i in (0, 1) for f in GPU_FIGURES}
    expected |= {"gpu/util_spread_pct", "gpu/stall_suspected", "gpu/samples"}
    assert set(monitor.keys) == expected
    h = history.history
    assert h["gpu/gpu0_util_mean_pct"] == [20.0, 20.0]
    assert h["gpu/gpu1_mem_used_max_mb"] == [4000.0, 4000.0]
    assert h["gpu/util_spread_pct"] == [70.0, 70.0]
    assert nvml.open_handles == 0 and live_sampler_threads() == []


def test_samples_the_distributions_gpus_by_cuda_ordinal(monkeypatch):
    """A DataParallel over CUDA ordinals 1 and 3 of 4 visible GPUs: NVML
    samples those two, named as TensorFlow names them; the preallocation
    note is said once."""
    gpus = [fake_device("gpu", i) for i in range(4)]
    monkeypatch.setattr(jax_devices, "local_gpus", lambda: gpus)
    monkeypatch.setattr(
        jax_devices,
        "distribution_devices",
        lambda distribution=None, variables=(): [gpus[3], gpus[1]],
    )
    nvml = FakeNvml([gpu(f"GPU-{i}", util=10 * i) for i in range(4)])
    monkeypatch.setattr(
        gpu_load_monitor_module,
        "NvmlBackend",
        functools.partial(NvmlBackend, nvml=nvml, environ={}),
    )
    monitor = GPULoadMonitor(interval=0.002)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        history = fit(monitor)
        fit(GPULoadMonitor(interval=0.002), epochs=1)
    assert monitor.mode == "gpu" and monitor.devices == ["gpu1", "gpu3"]
    assert history.history["gpu/gpu3_util_mean_pct"] == [30.0, 30.0]
    notes = [str(w.message) for w in record if "preallocates" in str(w.message)]
    assert len(notes) == 1
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in notes[0]


def test_on_cpu_devices_as_on_tensorflow_without_gpus(monkeypatch):
    """JAX sees no GPU: NVML gets no positions (every visible GPU); without
    NVML, the psutil fallback with TensorFlow's cpu/ keys."""
    seen = []

    def no_driver(positions=None, **kwargs):
        seen.append(positions)
        return NvmlBackend(nvml=FakeNvml(fail_init=True), environ={})

    monkeypatch.setattr(gpu_load_monitor_module, "NvmlBackend", no_driver)
    devices = keras.distribution.list_devices("cpu")
    distribution = keras.distribution.DataParallel(devices=devices)
    monitor = GPULoadMonitor(interval=0.002)
    monitor._host_backend = HostBackend(FakePsutil((10.0, 90.0)))
    with distribution.scope():
        with pytest.warns(MonitorWarning, match="psutil instead"):
            history = fit(monitor)
    assert seen == [None]
    assert monitor.mode == "cpu"
    assert set(monitor.keys) == {
        "cpu/util_mean_pct",
        "cpu/util_max_pct",
        "cpu/core0_util_mean_pct",
        "cpu/core1_util_mean_pct",
        "cpu/util_spread_pct",
        "cpu/samples",
    }
    assert history.history["cpu/util_spread_pct"] == [80.0, 80.0]


def test_gather_workers_constructs_for_several_jax_processes():
    """Gathering runs across JAX processes (issue 29); the 2-process run
    is in tests/distribute/test_jax_monitors_jax.py."""
    assert GPULoadMonitor(gather_workers=True).gather_workers is True


@pytest.mark.parametrize("kwargs, error, match", GPU_LOAD_MONITOR_BAD_INPUT)
def test_bad_input_as_on_tensorflow(kwargs, error, match):
    with pytest.raises(error, match=match):
        GPULoadMonitor(**kwargs)

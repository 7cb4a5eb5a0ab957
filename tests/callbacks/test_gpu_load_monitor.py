"""GPULoadMonitor: every figure against a fake NVML, fallback, leaks, on
both backends; on JAX also the distribution's GPUs chosen by CUDA ordinal
and no TensorFlow imported."""

from __future__ import annotations

import csv
import functools
import glob
import importlib.util
import math
import sys
import time
import warnings

import numpy as np
import pytest
from _training import mlp, regression_data
from monitoring._monitor_cases import GPU_FIGURES, GPU_LOAD_MONITOR_BAD_INPUT
from monitoring._monitor_fakes import FakeNvml, FakePsutil, gpu

from keras_mgpu._flavour import keras, tf
from keras_mgpu.callbacks import GPULoadMonitor
from keras_mgpu.callbacks import gpu_load_monitor as gpu_load_monitor_module
from keras_mgpu.monitoring import (
    HostBackend,
    MonitorWarning,
    NvmlBackend,
    notices,
)
from keras_mgpu.monitoring.sampler import live_sampler_threads

pytestmark = pytest.mark.backends("tensorflow", "jax")

JAX = keras.backend.backend() == "jax"
# Keras's TensorBoard callback writes through TensorFlow's summary ops: on
# JAX that would import TensorFlow, which this module forbids there.
HAS_TENSORBOARD = (
    not JAX and importlib.util.find_spec("tensorboard") is not None
)


@pytest.fixture(autouse=True)
def _fresh_notes(monkeypatch):
    monkeypatch.setattr(notices, "_PROCESS_NOTES", set())
    monkeypatch.delenv("XLA_PYTHON_CLIENT_PREALLOCATE", raising=False)
    monkeypatch.delenv("XLA_PYTHON_CLIENT_ALLOCATOR", raising=False)
    if JAX:
        # Nothing here may import TensorFlow on JAX: an import now fails.
        monkeypatch.setitem(sys.modules, "tensorflow", None)


# What the psutil fallback logs with two (faked) cores.
CPU_KEYS_OF_TWO_CORES = {
    "cpu/util_mean_pct",
    "cpu/util_max_pct",
    "cpu/core0_util_mean_pct",
    "cpu/core1_util_mean_pct",
    "cpu/util_spread_pct",
    "cpu/samples",
}


def compiled_model():
    model = mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    return model


def two_fake_gpus():
    return FakeNvml(
        [
            # Idle with full memory: the stall pattern.
            gpu(
                "GPU-a",
                util=20,
                used_mb=15000,
                total_mb=16000,
                power_w=100.0,
                temp_c=50,
                reasons=0x4,
            ),
            gpu(
                "GPU-b",
                util=90,
                used_mb=4000,
                total_mb=16000,
                power_w=300.0,
                temp_c=80,
                reasons=0x8,
                unsupported={"temp"},
            ),
        ]
    )


def with_backend(monitor, backend, host_backend=None):
    """Give the monitor stand-in backends (private attributes: test seams
    are not part of the public signature)."""
    monitor._backend_arg = backend
    if host_backend is not None:
        monitor._host_backend = host_backend
    return monitor


def wait_for_no_sampler(timeout=2.0):
    deadline = time.monotonic() + timeout
    while live_sampler_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    return live_sampler_threads()


def test_every_figure_reaches_history_csv_tensorboard_and_progbar(
    tmp_path, capsys
):
    x, y = regression_data(64)
    nvml = two_fake_gpus()
    monitor = with_backend(
        GPULoadMonitor(interval=0.002), NvmlBackend(nvml=nvml, environ={})
    )
    csv_path = tmp_path / "log.csv"
    callbacks = [monitor, keras.callbacks.CSVLogger(str(csv_path))]
    if HAS_TENSORBOARD:  # Keras's TensorBoard callback needs the package
        callbacks.append(keras.callbacks.TensorBoard(str(tmp_path / "tb")))
    with pytest.warns(MonitorWarning, match="input pipeline") as record:
        history = compiled_model().fit(
            x,
            y,
            epochs=2,
            batch_size=16,
            verbose=2,
            callbacks=callbacks,
        )
    stall = [w for w in record if "input pipeline" in str(w.message)]
    assert len(stall) == 1  # once per run, not per epoch
    assert "gpu0 (20% busy, 94% memory)" in str(stall[0].message)

    expected = {f"gpu/gpu{i}_{f}" for i in (0, 1) for f in GPU_FIGURES}
    expected |= {"gpu/util_spread_pct", "gpu/stall_suspected", "gpu/samples"}
    assert set(monitor.keys) == expected
    h = history.history
    assert expected <= set(h)
    for key in expected:
        assert len(h[key]) == 2, key
    assert h["gpu/gpu0_util_mean_pct"] == [20.0, 20.0]
    assert h["gpu/gpu1_util_max_pct"] == [90.0, 90.0]
    assert h["gpu/gpu0_mem_used_max_mb"][0] == 15000.0
    assert h["gpu/gpu1_mem_total_mb"][0] == 16000.0
    assert h["gpu/gpu1_power_mean_w"][0] == pytest.approx(300.0)
    assert h["gpu/gpu0_temp_max_c"][0] == 50.0
    assert math.isnan(h["gpu/gpu1_temp_max_c"][0])  # not supported: NaN
    assert h["gpu/gpu0_throttle_power_frac"][0] == 1.0
    assert h["gpu/gpu0_throttle_hw_frac"][0] == 0.0
    assert h["gpu/gpu1_throttle_hw_frac"][0] == 1.0
    assert h["gpu/util_spread_pct"] == [70.0, 70.0]
    assert h["gpu/stall_suspected"] == [1.0, 1.0]
    assert min(h["gpu/samples"]) >= 1.0
    assert nvml.open_handles == 0 and live_sampler_threads() == []

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 2 and expected <= set(rows[0])
    assert float(rows[1]["gpu/util_spread_pct"]) == 70.0

    if HAS_TENSORBOARD:
        assert "epoch_gpu/gpu1_util_mean_pct" in tensorboard_tags(tmp_path)

    assert "gpu/util_spread_pct: 70.0000" in capsys.readouterr().out


def tensorboard_tags(tmp_path):
    tags = set()
    for path in glob.glob(str(tmp_path / "tb" / "train" / "events*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            tags |= {v.tag for v in event.summary.value}
    return tags


def test_without_nvml_logs_cpu_per_core_and_warns_once():
    x, y = regression_data(32)
    nvml = FakeNvml(fail_init=True)
    monitor = with_backend(
        GPULoadMonitor(interval=0.002),
        NvmlBackend(nvml=nvml, environ={}),
        HostBackend(psutil_module=FakePsutil((10.0, 90.0))),
    )
    with pytest.warns(MonitorWarning, match="psutil instead") as record:
        history = compiled_model().fit(
            x, y, epochs=2, batch_size=16, verbose=0, callbacks=[monitor]
        )
    assert sum("psutil instead" in str(w.message) for w in record) == 1
    assert "no NVIDIA driver or GPU" in str(record[0].message)
    h = history.history
    assert monitor.mode == "cpu"
    assert set(monitor.keys) == CPU_KEYS_OF_TWO_CORES
    assert h["cpu/util_mean_pct"] == [50.0, 50.0]
    assert h["cpu/core1_util_mean_pct"] == [90.0, 90.0]
    assert h["cpu/util_spread_pct"] == [80.0, 80.0]


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_no_leak_over_20_fits_with_exceptions_and_interrupts():
    x, y = regression_data(32)
    model = compiled_model()
    nvml = two_fake_gpus()
    monitor = with_backend(
        GPULoadMonitor(interval=0.002), NvmlBackend(nvml=nvml, environ={})
    )

    class Fail(keras.callbacks.Callback):
        def __init__(self, error):
            super().__init__()
            self.error = error

        def on_train_batch_begin(self, batch, logs=None):
            if batch == 1 and self.error is not None:
                raise self.error

    for run in range(20):
        error = {5: RuntimeError("boom"), 11: KeyboardInterrupt()}.get(run)
        callbacks = [monitor, Fail(error)]
        if error is None:
            model.fit(x, y, batch_size=16, verbose=0, callbacks=callbacks)
            assert live_sampler_threads() == []
        else:
            with pytest.raises(type(error)):
                model.fit(x, y, batch_size=16, verbose=0, callbacks=callbacks)
            # Keras skipped on_train_end: the sampler notices by itself.
            assert wait_for_no_sampler() == []
        assert nvml.open_handles == 0, run
    assert nvml.inits == 20


def test_batch_logging_is_opt_in():
    x, y = regression_data(64)
    off = with_backend(
        GPULoadMonitor(), NvmlBackend(nvml=two_fake_gpus(), environ={})
    )
    # Without batch logging no batch hook: Keras keeps async dispatch.
    assert "on_train_batch_end" not in vars(off)
    monitor = with_backend(
        GPULoadMonitor(interval=0.002, update_freq=2),
        NvmlBackend(nvml=two_fake_gpus(), environ={}),
    )
    seen = []

    class Record(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            seen.append(sorted(k for k in logs if k.startswith("gpu/")))

    with pytest.warns(MonitorWarning):
        compiled_model().fit(
            x, y, batch_size=16, verbose=0, callbacks=[monitor, Record()]
        )
    assert seen[0] == [] and seen[2] == []
    assert seen[1] == [
        "gpu/gpu0_mem_used_mb",
        "gpu/gpu0_util_pct",
        "gpu/gpu1_mem_used_mb",
        "gpu/gpu1_util_pct",
    ]


def fit_jax(monitor, epochs=2):
    x, y = regression_data(32)
    return compiled_model().fit(
        x, y, epochs=epochs, batch_size=16, verbose=0, callbacks=[monitor]
    )


@pytest.mark.backends("jax")
def test_samples_the_distributions_gpus_by_cuda_ordinal(monkeypatch):
    """A DataParallel over CUDA ordinals 1 and 3 of 4 visible GPUs: NVML
    samples those two, named as TensorFlow names them; the preallocation
    note is said once."""
    from monitoring._jax_fakes import fake_device

    from keras_mgpu.backend.jax import devices as jax_devices

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
        history = fit_jax(monitor)
        fit_jax(GPULoadMonitor(interval=0.002), epochs=1)
    assert monitor.mode == "gpu" and monitor.devices == ["gpu1", "gpu3"]
    assert history.history["gpu/gpu3_util_mean_pct"] == [30.0, 30.0]
    notes = [str(w.message) for w in record if "preallocates" in str(w.message)]
    assert len(notes) == 1
    assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in notes[0]


@pytest.mark.backends("jax")
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
            history = fit_jax(monitor)
    assert seen == [None]
    assert monitor.mode == "cpu"
    assert set(monitor.keys) == CPU_KEYS_OF_TWO_CORES
    assert history.history["cpu/util_spread_pct"] == [80.0, 80.0]


@pytest.mark.backends("jax")
def test_gather_workers_constructs_for_several_jax_processes():
    """Gathering runs across JAX processes (issue 29); the 2-process run
    is in tests/distribute/test_jax_monitors_jax.py."""
    assert GPULoadMonitor(gather_workers=True).gather_workers is True


@pytest.mark.parametrize("kwargs, error, match", GPU_LOAD_MONITOR_BAD_INPUT)
def test_bad_input(kwargs, error, match):
    with pytest.raises(error, match=match):
        GPULoadMonitor(**kwargs)


def test_deprecated_name_warns_and_options_are_keyword_only():
    with pytest.warns(FutureWarning, match="use `update_freq` instead") as w:
        assert GPULoadMonitor(log_every_n_batches=0).update_freq == "epoch"
    assert w[0].filename == __file__  # the user's line, not ours
    with pytest.raises(TypeError):
        GPULoadMonitor(0.5)


@pytest.mark.gpu
@pytest.mark.backends("tensorflow")
def test_real_nvml_during_fit():
    if not tf.config.list_physical_devices("GPU"):
        pytest.skip("no GPU")
    x, y = regression_data(4096)
    monitor = GPULoadMonitor(interval=0.05)
    history = compiled_model().fit(
        x, y, epochs=2, batch_size=64, verbose=0, callbacks=[monitor]
    )
    assert monitor.mode == "gpu"
    util = np.asarray(history.history["gpu/gpu0_util_mean_pct"])
    assert np.all((util >= 0) & (util <= 100))
    assert history.history["gpu/gpu0_mem_total_mb"][0] > 1000
    assert live_sampler_threads() == []

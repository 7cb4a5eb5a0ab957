"""keras_mgpu.backend.jax.devices and .memory: the devices a distribution
uses, their names, `memory_stats()` read through a fake, the preallocation
note."""

from __future__ import annotations

import jax
import keras
import numpy as np
import pytest
from monitoring._jax_fakes import FakeMemoryStats, fake_device

from keras_mgpu.backend.jax import devices as jax_devices
from keras_mgpu.backend.jax import memory


def test_devices_of_the_distribution_in_force():
    cpus = jax.local_devices()
    # No distribution: JAX's default device, as TF's default strategy.
    assert jax_devices.distribution_devices() == [cpus[0]]
    devices = keras.distribution.list_devices("cpu")
    data_parallel = keras.distribution.DataParallel(devices=devices[2:])
    assert jax_devices.distribution_devices(data_parallel) == cpus[2:]
    with data_parallel.scope():
        assert jax_devices.distribution_devices() == cpus[2:]
    # A variable on another device adds it, after the mesh's.
    variable = jax.device_put(np.zeros(2), cpus[1])
    assert jax_devices.distribution_devices(data_parallel, [variable]) == [
        cpus[2],
        cpus[3],
        cpus[1],
    ]
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], devices)
    model_parallel = keras.distribution.ModelParallel(
        layout_map=keras.distribution.LayoutMap(mesh), batch_dim_name="batch"
    )
    assert jax_devices.distribution_devices(model_parallel) == cpus
    assert [jax_devices.device_name(d) for d in cpus] == [
        f"CPU:{i}" for i in range(4)
    ]


def test_cpu_reads_nothing_and_no_gpu_positions():
    reader = memory.JAXMemoryReader()
    names = reader.bind(jax.local_devices())
    assert names == ["CPU:0", "CPU:1", "CPU:2", "CPU:3"]
    assert reader.read("CPU:0") is None  # memory_stats() is None on CPU
    assert reader.capacity_mb("CPU:0") is None
    assert reader.reset("CPU:0") is False
    assert jax_devices.local_gpus() == []
    assert jax_devices.gpu_positions() is None


def test_reader_with_fake_memory_stats():
    fake = FakeMemoryStats({0: (100, 250, 1000), 3: (1, 2, None)})
    reader = memory.JAXMemoryReader(fake)
    assert reader.bind([*fake.gpus(), fake_device("cpu", 0)]) == [
        "GPU:0",
        "GPU:3",
        "CPU:0",
    ]
    assert reader.read("GPU:0") == {"current_mb": 100.0, "peak_mb": 250.0}
    assert reader.capacity_mb("GPU:0") == 1000.0
    assert reader.capacity_mb("GPU:3") is None
    assert reader.read("CPU:0") is None
    assert reader.read("GPU:7") is None  # never bound

    def broken(device):
        raise RuntimeError("device lost")

    assert memory.JAXMemoryReader(broken).read("GPU:0") is None


@pytest.mark.parametrize(
    "environ, on",
    [
        ({}, True),
        ({"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}, True),
        ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, False),
        ({"XLA_PYTHON_CLIENT_PREALLOCATE": "False"}, False),
        ({"XLA_PYTHON_CLIENT_PREALLOCATE": "0"}, False),
        ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, False),
        ({"XLA_PYTHON_CLIENT_ALLOCATOR": "PLATFORM"}, False),
        ({"XLA_PYTHON_CLIENT_ALLOCATOR": "bfc"}, True),
    ],
)
def test_preallocation_note(environ, on):
    note = memory.preallocation_note(environ)
    assert (note is not None) == on
    if on:
        assert "XLA_PYTHON_CLIENT_PREALLOCATE=false" in note
        assert "before JAX starts" in note

"""NvmlBackend against a fake NVML; the real one where a GPU exists."""

from __future__ import annotations

import math
import shutil

import pytest
from monitoring._monitor_fakes import FakeNvml, gpu

from keras_mgpu.monitoring import (
    BackendUnavailable,
    NvmlBackend,
    visible_gpu_selectors,
)

UUIDS = ["GPU-aaaa1111", "GPU-bbbb2222", "GPU-cccc3333"]


def three_gpus(**kwargs):
    return FakeNvml(
        [gpu(u, util=10 * (i + 1), **kwargs) for i, u in enumerate(UUIDS)]
    )


SELECTORS = [
    (None, None),
    ("", []),
    ("-1", []),
    ("1,0", ["1", "0"]),
    (" 2 , GPU-bbbb", ["2", "GPU-bbbb"]),
    ("0,-1,1", ["0"]),
]
VISIBLE = [
    (None, UUIDS),
    ("2,0", [UUIDS[2], UUIDS[0]]),
    ("GPU-cccc,GPU-aaaa1111", [UUIDS[2], UUIDS[0]]),
    ("1,7,0", [UUIDS[1]]),  # CUDA stops at the first bad entry
]


def test_respects_cuda_visible_devices():
    # One test, many cases: each test pays the autouse session reset.
    for value, expected in SELECTORS:
        env = {} if value is None else {"CUDA_VISIBLE_DEVICES": value}
        assert visible_gpu_selectors(env) == expected, value
    for visible, uuids in VISIBLE:
        nvml = three_gpus()
        env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
        backend = NvmlBackend(nvml=nvml, environ=env)
        backend.open()
        assert backend.uuids == uuids, visible
        assert backend.devices == [f"gpu{i}" for i in range(len(uuids))]
        if visible == "1,7,0":
            assert "'7' matches no GPU" in backend.notes[0]
        backend.close()
        assert nvml.open_handles == 0


def test_positions_pick_the_strategy_gpus():
    backend = NvmlBackend(positions=[1], nvml=three_gpus(), environ={})
    backend.open()
    assert backend.devices == ["gpu1"] and backend.uuids == [UUIDS[1]]
    assert backend.sample()["gpu1/util"] == 20.0
    backend.close()


def test_sample_every_figure():
    nvml = FakeNvml(
        [
            gpu(
                "GPU-a",
                util=75,
                used_mb=3000,
                total_mb=16000,
                power_w=250.5,
                temp_c=71,
                reasons=0x4 | 0x40 | 0x1,
            )
        ]
    )
    backend = NvmlBackend(nvml=nvml, environ={})
    backend.open()
    assert backend.sample() == {
        "gpu0/util": 75.0,
        "gpu0/mem_used_mb": 3000.0,
        "gpu0/mem_total_mb": 16000.0,
        "gpu0/power_w": 250.5,
        "gpu0/temp_c": 71.0,
        "gpu0/throttle_power": 1.0,
        "gpu0/throttle_thermal": 1.0,
        "gpu0/throttle_hw": 0.0,
    }
    assert backend.total_memory_mb() == {"gpu0": 16000.0}
    backend.close()
    backend.close()  # idempotent
    assert (nvml.inits, nvml.shutdowns) == (1, 1)


def test_unsupported_figures_are_nan():
    nvml = FakeNvml([gpu("GPU-a", unsupported={"power", "reasons"})])
    backend = NvmlBackend(nvml=nvml, environ={})
    backend.open()
    sample = backend.sample()
    assert math.isnan(sample["gpu0/power_w"])
    assert math.isnan(sample["gpu0/throttle_hw"])
    assert sample["gpu0/util"] == 50.0
    backend.close()


def test_unavailable_without_driver_or_gpus():
    with pytest.raises(BackendUnavailable, match="NVML could not start"):
        NvmlBackend(nvml=FakeNvml(fail_init=True)).open()
    nvml = three_gpus()
    with pytest.raises(BackendUnavailable, match="no GPU is visible"):
        NvmlBackend(nvml=nvml, environ={"CUDA_VISIBLE_DEVICES": ""}).open()
    assert nvml.open_handles == 0  # init undone


def test_real_pynvml_without_driver_is_unavailable():
    pytest.importorskip("pynvml")
    if shutil.which("nvidia-smi"):
        pytest.skip("a GPU driver is present")
    with pytest.raises(BackendUnavailable, match="NVML could not start"):
        NvmlBackend().open()


@pytest.mark.gpu
def test_real_nvml_on_a_gpu():
    pytest.importorskip("pynvml")
    backend = NvmlBackend()
    try:
        backend.open()
    except BackendUnavailable as exc:
        pytest.skip(f"no usable GPU: {exc}")
    sample = backend.sample()
    backend.close()
    assert 0.0 <= sample["gpu0/util"] <= 100.0
    assert sample["gpu0/mem_total_mb"] > 1000.0
    assert not backend.is_open

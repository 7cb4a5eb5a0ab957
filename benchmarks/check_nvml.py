"""Check the NVML monitoring path on a real GPU, without TensorFlow.

`keras_mgpu.monitoring` (NVML, psutil, the sampling thread) needs no deep
learning framework, so this runs on any machine with an NVIDIA driver and
`nvidia-ml-py`. It samples the GPUs with `NvmlBackend` + `Sampler` (the
code `GPULoadMonitor` runs) while idle and while a load runs on GPU 0 (a
matrix-multiply loop through PyTorch or CuPy, whichever is installed), and
compares the memory figures with `nvidia-smi`. It also checks that
`CUDA_VISIBLE_DEVICES` (by index and by UUID) selects the GPUs sampled, and
that no sampler thread or NVML handle outlives a run. Prints one JSON line.

    python benchmarks/check_nvml.py [--seconds 4] [--interval 0.1]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load(seconds: float, stop: threading.Event, info: dict) -> None:
    """Busy GPU 0 with matrix multiplies and hold ~2 GiB for `seconds`."""
    try:
        import torch

        a = torch.randn(8192, 8192, device="cuda")
        hold = torch.empty(2**29, device="cuda")  # 2 GiB of float32
        info["framework"] = "torch"
        end = time.monotonic() + seconds
        while time.monotonic() < end and not stop.is_set():
            a = torch.tanh(a @ a * 1e-4)
            torch.cuda.synchronize()
        info["held_mb"] = hold.numel() * 4 / 2**20
        del hold, a
        torch.cuda.empty_cache()
    except ImportError:
        import cupy

        a = cupy.random.randn(8192, 8192, dtype=cupy.float32)
        hold = cupy.empty(2**29, dtype=cupy.float32)
        info["framework"] = "cupy"
        end = time.monotonic() + seconds
        while time.monotonic() < end and not stop.is_set():
            a = cupy.tanh(a @ a * 1e-4)
            cupy.cuda.Device().synchronize()
        info["held_mb"] = hold.size * 4 / 2**20


def _smi(query: str) -> list[str]:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line.strip() for line in out.stdout.strip().splitlines()]


def _window(args, load: bool) -> dict:
    from keras_mgpu.monitoring import NvmlBackend, Sampler

    backend = NvmlBackend()
    backend.open()
    sampler = Sampler(backend.sample, args.interval, on_stop=backend.close)
    info: dict = {}
    stop = threading.Event()
    worker = threading.Thread(target=_load, args=(args.seconds, stop, info))
    sampler.start()
    if load:
        worker.start()
        time.sleep(args.seconds / 2)
        smi_used = float(_smi("memory.used")[0])
        worker.join()
    else:
        time.sleep(args.seconds)
        smi_used = float(_smi("memory.used")[0])
    samples = sampler.samples
    stats = sampler.collect()
    sampler.stop()
    figures = {
        name: {"mean": round(s.mean, 2), "max": round(s.max, 2)}
        for name, s in sorted(stats.items())
        if name.startswith("gpu0/")
    }
    return {
        "samples": samples,
        "gpu0": figures,
        "nvidia_smi_used_mb_midway": smi_used,
        "handle_closed": not backend.is_open,
        **info,
    }


def _selection() -> dict:
    from keras_mgpu.monitoring import NvmlBackend

    uuid = _smi("uuid")[0]
    found = {}
    for name, value in (
        ("index", "0"),
        ("uuid", uuid),
        ("uuid_prefix", uuid[:12]),
        ("hidden", ""),
    ):
        backend = NvmlBackend(environ={"CUDA_VISIBLE_DEVICES": value})
        try:
            backend.open()
            found[name] = list(backend.devices)
            backend.close()
        except Exception as exc:
            found[name] = f"{type(exc).__name__}: {exc}"
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--interval", type=float, default=0.1)
    args = parser.parse_args()
    import keras_mgpu.monitoring  # noqa: F401
    from keras_mgpu.monitoring.sampler import live_sampler_threads

    result = {
        "check": "nvml",
        "tensorflow_imported": "tensorflow" in sys.modules,
        "gpus": _smi("name,memory.total,driver_version"),
        "idle": _window(args, load=False),
        "loaded": _window(args, load=True),
        "cuda_visible_devices": _selection(),
        "sampler_threads_left": len(live_sampler_threads()),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()

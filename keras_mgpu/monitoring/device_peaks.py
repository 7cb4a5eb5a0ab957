"""Dense peak FLOP/s of accelerators, by device kind and compute dtype, for
model FLOPs utilization (MFU) in `ThroughputMonitor`.

Figures are the vendors' *dense* peaks (datasheets quote tensor-core peaks
with 2:4 structured sparsity, twice these; MFU is always taken against the
dense figure). One device is what JAX calls a device and TensorFlow a
logical GPU: one GPU, one TPU chip (v4 and v5p chips are one JAX device
each, megacore). `float32` matmuls run as TF32 on Ampere and newer by
default in both TensorFlow (`tf.config.experimental.
enable_tensor_float_32_execution`) and JAX (default matmul precision), so a
`float32` model is held to the TF32 peak where the device has one
(`peak_dtype` resolves it).

Sources (dense figures, TFLOP/s):
- H100 SXM5 / H200 SXM: NVIDIA H100 and H200 datasheets (2023, 2024):
  FP32 67, TF32 494.7, BF16/FP16 989.4, FP8 1978.9.
- H100 PCIe: NVIDIA H100 datasheet: FP32 51, TF32 378, BF16/FP16 756,
  FP8 1513.
- A100 (SXM and PCIe, 40/80 GB): NVIDIA A100 datasheet (2021): FP32 19.5,
  TF32 156, BF16/FP16 312.
- L4: NVIDIA L4 datasheet (2023): FP32 30.3, TF32 60, BF16/FP16 121,
  FP8 242.
- L40S: NVIDIA L40S datasheet (2023): FP32 91.6, TF32 183, BF16/FP16 362,
  FP8 733.
- V100 SXM2 / PCIe: NVIDIA V100 datasheet: FP32 15.7 / 14, FP16 (tensor
  cores) 125 / 112.
- T4: NVIDIA T4 datasheet: FP32 8.1, FP16 65.
- TPU v4: 275 BF16 per chip; v5e ("TPU v5 lite"): 197; v5p ("TPU v5"):
  459; v6e ("TPU v6 lite", Trillium): 918 (Google Cloud TPU system
  architecture pages, 2024).
"""

from __future__ import annotations

import re

TERA = 1e12

# (pattern on the device kind, lower-cased; peaks in TFLOP/s by dtype).
# The order matters: the first match wins (PCIe before the SXM default).
_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    (
        r"h100.*pcie",
        {
            "float32": 51.0,
            "tf32": 378.0,
            "bfloat16": 756.0,
            "float16": 756.0,
            "float8": 1513.0,
        },
    ),
    (
        r"h100|h200|gh200",
        {
            "float32": 67.0,
            "tf32": 494.7,
            "bfloat16": 989.4,
            "float16": 989.4,
            "float8": 1978.9,
        },
    ),
    (
        r"a100",
        {"float32": 19.5, "tf32": 156.0, "bfloat16": 312.0, "float16": 312.0},
    ),
    (
        r"l40s",
        {
            "float32": 91.6,
            "tf32": 183.0,
            "bfloat16": 362.0,
            "float16": 362.0,
            "float8": 733.0,
        },
    ),
    (
        r"\bl4\b",
        {
            "float32": 30.3,
            "tf32": 60.0,
            "bfloat16": 121.0,
            "float16": 121.0,
            "float8": 242.0,
        },
    ),
    (r"v100.*pcie", {"float32": 14.0, "float16": 112.0}),
    (r"v100", {"float32": 15.7, "float16": 125.0}),
    (r"\bt4\b", {"float32": 8.1, "float16": 65.0}),
    (r"tpu v6|tpu v6e|trillium", {"bfloat16": 918.0}),
    (r"tpu v5 ?lite|tpu v5e", {"bfloat16": 197.0}),
    (r"tpu v5p|tpu v5$", {"bfloat16": 459.0}),
    (r"tpu v4", {"bfloat16": 275.0}),
)

# What a Keras compute dtype is called in the table.
_DTYPES = {
    "float32": "float32",
    "bfloat16": "bfloat16",
    "float16": "float16",
    "float8_e4m3fn": "float8",
    "float8_e5m2": "float8",
    "float8": "float8",
    "tf32": "tf32",
}


def device_peaks(device_kind: str) -> dict[str, float] | None:
    """The dense peaks (FLOP/s, by table dtype) of `device_kind` (JAX's
    `device_kind`, TensorFlow's `device_name` detail or NVML's name, e.g.
    "NVIDIA H100 80GB HBM3"); None for a device not in the table."""
    kind = str(device_kind).lower()
    for pattern, peaks in _PEAKS:
        if re.search(pattern, kind):
            return {dtype: tflops * TERA for dtype, tflops in peaks.items()}
    return None


def peak_dtype(compute_dtype: str, peaks: dict[str, float]) -> str | None:
    """The table dtype a model of `compute_dtype` runs its matmuls in on a
    device with `peaks`: `float32` is TF32 where the device has it."""
    name = _DTYPES.get(str(compute_dtype))
    if name == "float32" and "tf32" in peaks:
        return "tf32"
    if name in peaks:
        return name
    return None


def peak_flops(device_kind: str, compute_dtype: str) -> float | None:
    """Dense peak FLOP/s of one `device_kind` device for `compute_dtype`
    (a Keras dtype: "float32", "bfloat16", ...); None when unknown (a CPU,
    a device or dtype not in the table).

    Example:

    ```python
    peak_flops("NVIDIA H100 80GB HBM3", "bfloat16")  # 9.894e14
    ```
    """
    peaks = device_peaks(device_kind)
    if peaks is None:
        return None
    dtype = peak_dtype(compute_dtype, peaks)
    return None if dtype is None else peaks[dtype]

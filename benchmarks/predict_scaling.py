"""Scaling on paper: `keras_mgpu.monitoring.predict_scaling` at 8, 64 and
512 GPUs, for Horovod's published 512-GPU setup and for a current one.

Nothing runs on a device: the bytes per update are the models' trainable
parameters in float32 (`update_bytes`), the step times are the inputs
stated below, and the table is arithmetic (docs/guides/scaling.md shows it
and explains each number).

- `horovod_2018`: the setup of Horovod's 512-GPU benchmark (Sergeev & Del
  Balso 2018; horovod docs/benchmarks: 128 servers x 4 Pascal GPUs,
  RoCE-capable 25 Gbit/s network; published 90% scaling efficiency for
  Inception V3 and ResNet-101, 68% for VGG-16; its reproduction
  instructions run tf_cnn_benchmarks at batch 64 per GPU). Inside a server
  the GPUs are taken to share PCIe 3.0 x16.
  Step times on one P100 at batch 64: Inception V3 from TensorFlow's
  published DGX-1 P100 benchmark (142 images/s, 2017); ResNet-101 and
  VGG-16 assumed (ResNet-50's 219 images/s scaled by the models' FLOPs).
- `h100_2024`: 8 GPUs per host on NVLink 4, 8 x 400 Gb/s per host.
  Step times assumed: ResNet-50 85 ms (batch 256, mixed precision),
  BERT-large 250 ms (sequence 512, batch 16, mixed precision); gradients
  still reduced in float32 (Keras keeps float32 variables under
  `mixed_float16` / `mixed_bfloat16`).

Prints one JSON line per (setup, model, devices).

Usage: python benchmarks/predict_scaling.py [--latency-us 0]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from keras_mgpu.monitoring.communication import (  # noqa: E402
    INTERCONNECTS,
    predict_scaling,
    update_bytes,
)

# Trainable parameters of keras.applications models (weights=None, 1000
# classes; Keras 3.15), and BERT-large (24 layers, hidden 1024, FFN 4096,
# vocabulary 30522, 512 positions, with pooler) counted by hand.
PARAMETERS = {
    "ResNet-50": 25_583_592,
    "ResNet-101": 44_601_832,
    "Inception V3": 23_817_352,
    "VGG-16": 138_357_544,
    "BERT-large": 335_141_888,
}

SETUPS = {
    "horovod_2018": {
        "gpus_per_host": 4,
        "intra_host_gbps": "pcie3_x16",
        "inter_host_gbps": "network_25gbit",
        "models": {
            # model: (seconds per step at batch 64 on one P100, published
            # efficiency at 512 GPUs)
            "Inception V3": (64 / 142, 0.90),
            "ResNet-101": (64 / 115, 0.90),
            "VGG-16": (64 / 58, 0.68),
        },
    },
    "h100_2024": {
        "gpus_per_host": 8,
        "intra_host_gbps": "nvlink4",
        "inter_host_gbps": 8 * INTERCONNECTS["network_400gbit"],
        "models": {
            "ResNet-50": (0.085, None),
            "BERT-large": (0.250, None),
        },
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--latency-us",
        type=float,
        default=0.0,
        help="seconds per ring step, in microseconds (default 0)",
    )
    parser.add_argument("--devices", type=int, nargs="+", default=[8, 64, 512])
    args = parser.parse_args()
    for setup, spec in SETUPS.items():
        for model, (step, published) in spec["models"].items():
            traffic = update_bytes(PARAMETERS[model])
            for devices in args.devices:
                hosts = max(1, devices // spec["gpus_per_host"])
                common = dict(
                    step_seconds=step,
                    bytes_per_update=traffic,
                    devices=devices,
                    hosts=hosts,
                    intra_host_gbps=spec["intra_host_gbps"],
                    inter_host_gbps=spec["inter_host_gbps"],
                    latency_seconds=args.latency_us * 1e-6,
                )
                serial = predict_scaling(**common)
                overlapped = predict_scaling(**common, overlap=True)
                print(
                    json.dumps(
                        {
                            "setup": setup,
                            "model": model,
                            "parameters": traffic.parameters,
                            "bytes_per_update": traffic.bytes_per_update,
                            "step_seconds": round(step, 4),
                            "devices": devices,
                            "hosts": hosts,
                            "communication_seconds": round(
                                serial.communication_seconds, 4
                            ),
                            "efficiency": round(serial.efficiency, 3),
                            "efficiency_overlapped": round(
                                overlapped.efficiency, 3
                            ),
                            "published_efficiency": (
                                published if devices == 512 else None
                            ),
                        }
                    )
                )


if __name__ == "__main__":
    main()

"""Benchmark: `keras_mgpu.sharding.plan_layout_map` against keras-hub's own
`get_layout_map` and the unsharded model, on Keras's JAX backend.

Models, built from configs (no download): keras-hub Gemma and Llama
backbones (keras-hub ships a layout map for them), a GPT-2 backbone and a
functional MLP (it has none). Per model and mesh, one JSON line:

- `param_bytes`: the unsharded model's variables.
- `planned_bytes_per_device`, `hub_bytes_per_device`: what one device holds
  under the planned map and under keras-hub's (None: no map, or the map does
  not fit the model, with `hub_error`), computed by `check_layout_map` and
  checked against the devices' shards of the model built under the map.
- `planned_fraction`, `hub_fraction`: those over `param_bytes`
  (1 / model-axis size is the ideal of a model-axis split; the balanced
  policy also splits along the batch axis).
- `step_ms_unsharded`, `step_ms_planned`, `step_ratio`: median
  `train_on_batch` time (Adam, MSE on the sequence output) without a
  distribution and under `ModelParallel` with the planned map, and the
  median ratio of steps timed in pairs (alternating which runs first). On CPU
  devices this measures XLA's SPMD collectives between host threads, not
  accelerator speed-ups.

    python benchmarks/bench_layout_jax.py --quick   # tiny configs, CPU
    python benchmarks/bench_layout_jax.py           # small configs
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
if "--quick" in sys.argv or "--cpu" in sys.argv:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_force_host_platform_device_count=4"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import keras  # noqa: E402
import numpy as np  # noqa: E402

from keras_mgpu.sharding import check_layout_map, plan_layout_map  # noqa: E402


def configs(quick: bool) -> dict:
    hidden, layers, vocab, seq = (
        (64, 1, 256, 8) if quick else (512, 4, 8192, 64)
    )
    return {
        "hidden": hidden,
        "layers": layers,
        "vocab": vocab,
        "seq": seq,
        "batch": 8 if quick else 16,
    }


def builders(c: dict) -> dict:
    import keras_hub

    def gemma():
        return keras_hub.models.GemmaBackbone(
            vocabulary_size=c["vocab"],
            num_layers=c["layers"],
            num_query_heads=8,
            num_key_value_heads=4,
            hidden_dim=c["hidden"],
            intermediate_dim=4 * c["hidden"],
            head_dim=c["hidden"] // 8,
        )

    def llama():
        return keras_hub.models.LlamaBackbone(
            vocabulary_size=c["vocab"],
            num_layers=c["layers"],
            num_query_heads=8,
            num_key_value_heads=4,
            hidden_dim=c["hidden"],
            intermediate_dim=4 * c["hidden"],
        )

    def gpt2():
        return keras_hub.models.GPT2Backbone(
            vocabulary_size=c["vocab"],
            num_layers=c["layers"],
            num_heads=8,
            hidden_dim=c["hidden"],
            intermediate_dim=4 * c["hidden"],
            max_sequence_length=c["seq"],
        )

    def mlp():
        inputs = keras.Input((c["hidden"],))
        x = inputs
        for i in range(2 * c["layers"]):
            x = keras.layers.Dense(
                4 * c["hidden"], activation="relu", name=f"up_{i}"
            )(x)
            x = keras.layers.Dense(c["hidden"], name=f"down_{i}")(x)
        return keras.Model(inputs, x, name="mlp")

    return {"gemma": gemma, "llama": llama, "gpt2": gpt2, "mlp": mlp}


def batch(name: str, c: dict):
    rng = np.random.default_rng(0)
    if name == "mlp":
        x = rng.normal(size=(c["batch"], c["hidden"])).astype("float32")
        return x, np.zeros_like(x)
    x = {
        "token_ids": rng.integers(0, c["vocab"], (c["batch"], c["seq"])),
        "padding_mask": np.ones((c["batch"], c["seq"]), "int32"),
    }
    return x, np.zeros((c["batch"], c["seq"], c["hidden"]), "float32")


def _timed(model, x, y) -> float:
    start = time.perf_counter()
    model.train_on_batch(x, y)
    return time.perf_counter() - start


def paired_step_ms(plain, sharded, distribution, x, y, steps: int):
    """Median step times, and the median ratio of steps run in pairs (a
    plain step right before or after a sharded one, alternating), so load
    that changes between pairs cancels."""
    plain.compile(keras.optimizers.Adam(1e-4), "mse")
    plain.train_on_batch(x, y)  # compile
    with distribution.scope():
        sharded.compile(keras.optimizers.Adam(1e-4), "mse")
        sharded.train_on_batch(x, y)
    plain_times, sharded_times, ratios = [], [], []
    for i in range(steps):
        if i % 2:
            with distribution.scope():
                b = _timed(sharded, x, y)
            a = _timed(plain, x, y)
        else:
            a = _timed(plain, x, y)
            with distribution.scope():
                b = _timed(sharded, x, y)
        plain_times.append(a)
        sharded_times.append(b)
        ratios.append(b / a)
    return (
        1000 * statistics.median(plain_times),
        1000 * statistics.median(sharded_times),
        statistics.median(ratios),
    )


def run(name: str, build, mesh_shape, c: dict, steps: int) -> dict:
    devices = keras.distribution.list_devices()[: mesh_shape[0] * mesh_shape[1]]
    mesh = keras.distribution.DeviceMesh(
        mesh_shape, ("batch", "model"), devices
    )
    keras.backend.clear_session()
    reference = build()
    planned_map = plan_layout_map(reference, mesh)
    planned = check_layout_map(reference, planned_map)
    row = {
        "model": name,
        "mesh": list(mesh_shape),
        "device": str(devices[0].split(":")[0]),
        "param_bytes": planned.param_bytes,
        "planned_bytes_per_device": planned.param_bytes_per_device,
        "planned_fraction": round(planned.sharded_fraction, 4),
        "planned_fallbacks": sorted(planned.fallbacks),
        "hub_bytes_per_device": None,
        "hub_fraction": None,
    }
    if hasattr(type(reference), "get_layout_map"):
        try:
            hub = check_layout_map(
                reference, type(reference).get_layout_map(mesh)
            )
            row["hub_bytes_per_device"] = hub.param_bytes_per_device
            row["hub_fraction"] = round(hub.sharded_fraction, 4)
            row["hub_fallbacks"] = sorted(hub.fallbacks)
        except ValueError as exc:
            row["hub_error"] = str(exc)[:200]
    x, y = batch(name, c)
    distribution = keras.distribution.ModelParallel(
        layout_map=planned_map, batch_dim_name="batch"
    )
    with distribution.scope():
        # Same layer names as `reference` (keras-hub names them; the MLP's
        # are given), so the planned map's paths match.
        sharded = build()
        measured = check_layout_map(sharded, planned_map)
    row["measured_bytes_per_device"] = measured.measured_param_bytes_per_device
    plain_ms, sharded_ms, ratio = paired_step_ms(
        reference, sharded, distribution, x, y, steps
    )
    row["step_ms_unsharded"] = round(plain_ms, 3)
    row["step_ms_planned"] = round(sharded_ms, 3)
    row["step_ratio"] = round(ratio, 3)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument(
        "--models", default="gemma,llama,gpt2,mlp", help="comma-separated"
    )
    args = parser.parse_args()
    c = configs(args.quick)
    steps = args.steps or (20 if args.quick else 40)
    builds = builders(c)
    for mesh_shape in ((2, 2), (1, 4)):
        for name in args.models.split(","):
            print(
                json.dumps(run(name, builds[name], mesh_shape, c, steps)),
                flush=True,
            )


if __name__ == "__main__":
    main()

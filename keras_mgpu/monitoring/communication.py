"""Scaling on paper: the bytes each optimizer update sends between devices,
and the time per update and scaling efficiency that predicts at N devices
on H hosts for a given link bandwidth.

Numbers only: `update_bytes` reads variable sizes (and, on JAX under a
`keras.distribution`, their layouts), `predict_scaling` is arithmetic, and
`train_step_collectives` (JAX) reads the compiled train step's collectives
from XLA's HLO text (`keras_mgpu.backend.jax.collectives`).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Sequence
from typing import Any

from keras_mgpu._validation import check_bool, check_int, check_number
from keras_mgpu.backend import backend, require_backend
from keras_mgpu.backend.jax.collectives import collective_bytes_from_hlo

__all__ = [
    "INTERCONNECTS",
    "ScalingPrediction",
    "UpdateTraffic",
    "collective_bytes_from_hlo",
    "predict_scaling",
    "train_step_collectives",
    "update_bytes",
]

#: Peak bandwidth of common links, **per direction, in GB/s (10**9 bytes
#: per second)**: what one device (NVLink, PCIe) or one host's port
#: (networks) can send while it receives as much. Vendors quote NVLink as
#: the sum of both directions, and networks in gigabits (Gb/s, divide by 8).
#: These are signalling peaks; NCCL's measured all-reduce bus bandwidth is
#: typically 70-90% of them, so predictions made with them are optimistic.
INTERCONNECTS: dict[str, float] = {
    # NVIDIA A100 datasheet: third-generation NVLink, 600 GB/s per GPU
    # (12 links x 50 GB/s, both directions together) = 300 per direction.
    "nvlink3": 300.0,
    # NVIDIA H100 / H200 datasheets: fourth-generation NVLink, 900 GB/s per
    # GPU (18 links x 50 GB/s, both directions) = 450 per direction.
    "nvlink4": 450.0,
    # NVIDIA B200 (DGX B200 / HGX B200): fifth-generation NVLink,
    # 1.8 TB/s per GPU (both directions) = 900 per direction.
    "nvlink5": 900.0,
    # PCI Express x16, per direction, after line encoding (128b/130b):
    # 3.0 at 8 GT/s, 4.0 at 16 GT/s, 5.0 at 32 GT/s.
    "pcie3_x16": 15.75,
    "pcie4_x16": 31.5,
    "pcie5_x16": 63.0,
    # Networks (Ethernet, RoCE or InfiniBand; per port, per direction):
    # 25 Gb/s = 3.125 GB/s (Horovod's 2018 benchmark network), 100 Gb/s
    # (EDR InfiniBand), 200 Gb/s (HDR), 400 Gb/s (NDR; a DGX H100 has one
    # such port per GPU: give `inter_host_gbps` the host's sum).
    "network_25gbit": 25 / 8,
    "network_100gbit": 100 / 8,
    "network_200gbit": 200 / 8,
    "network_400gbit": 400 / 8,
}

_GB = 1e9


@dataclasses.dataclass(frozen=True)
class UpdateTraffic:
    """What each device hands to the data-parallel gradient reduction per
    optimizer update (`update_bytes`).

    Attributes:
        parameters: elements of the trainable variables (whole model).
        payload_bytes: bytes one device contributes to one reduction: the
            gradient of its part of every variable, in the dtype it
            crosses in (compressed, if a method is in use).
        reductions_per_update: how many times that payload crosses per
            update (1, or the accumulation window on JAX, where every
            `fit` step reduces its gradients).
        bytes_per_update: `payload_bytes * reductions_per_update`.
        micro_steps_per_update: steps of `fit` per update.
        collectives_per_reduction: separate collective rounds in one
            reduction (PowerSGD: 2; float16 with its scale: 2; else 1).
        wire: how the payload crosses ("float32", "float16 (scaled)",
            "power_sgd rank 2", ...).
    """

    parameters: int
    payload_bytes: int
    reductions_per_update: int
    bytes_per_update: int
    micro_steps_per_update: int
    collectives_per_reduction: int
    wire: str

    def wire_bytes(self, devices: int) -> float:
        """Bytes one device sends per update with a ring all-reduce over
        `devices`: `2(N-1)/N * bytes_per_update`."""
        devices = check_int(devices, "devices", minimum=1)
        return 2.0 * (devices - 1) / devices * self.bytes_per_update


@dataclasses.dataclass(frozen=True)
class ScalingPrediction:
    """A `predict_scaling` result.

    Attributes:
        devices: devices in all.
        hosts: hosts they are spread over.
        step_seconds: compute time per update on one device (given).
        communication_seconds: time of the update's reductions.
        update_seconds: predicted time per update at `devices`.
        efficiency: `step_seconds / update_seconds`: throughput per device
            relative to one device at the same per-device batch.
        speedup: `devices * efficiency`.
        intra_host_bytes: bytes one device sends over its intra-host link.
        inter_host_bytes: bytes one host sends over its network.
    """

    devices: int
    hosts: int
    step_seconds: float
    communication_seconds: float
    update_seconds: float
    efficiency: float
    speedup: float
    intra_host_bytes: float
    inter_host_bytes: float


def _unwrap(optimizer: Any) -> list:
    """`optimizer` and the optimizers it wraps (`inner_optimizer` chains:
    LossScaleOptimizer, GradientAccumulationOptimizer)."""
    chain = []
    while optimizer is not None and all(optimizer is not o for o in chain):
        chain.append(optimizer)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return chain


def _accumulation(chain: list) -> tuple:
    """(window, compression, reduces once per window) of an optimizer
    chain."""
    for optimizer in chain:
        steps = getattr(optimizer, "accumulation_steps", None)
        if steps is not None:  # keras_mgpu.GradientAccumulationOptimizer
            # TensorFlow: one all-reduce of the window's mean per update.
            # JAX: XLA reduces the gradients inside each compiled step,
            # before any optimizer sees them: once per `fit` step.
            once = backend() == "tensorflow"
            return int(steps), getattr(optimizer, "compression", None), once
    for optimizer in chain:
        steps = getattr(optimizer, "gradient_accumulation_steps", None)
        if steps:  # Keras's built-in: gradients reduced every micro-step
            return int(steps), None, False
    return 1, None, True


def _element_bytes(dtype: Any) -> int:
    import numpy as np

    name = getattr(dtype, "name", dtype)
    if name == "bfloat16":
        return 2
    try:
        return int(np.dtype(name).itemsize)
    except TypeError as exc:
        raise ValueError(
            "Argument `dtype` must name a numeric dtype (e.g. 'float32', "
            f"'bfloat16'). Received: dtype={dtype!r}"
        ) from exc


def _local_shape(variable: Any, distribution: Any) -> tuple:
    """The part of `variable` one device reduces over the data axis: its
    shape divided along every mesh axis it is split over except the batch
    axis (a variable split over the batch axis, FSDP-style, is gathered
    whole for the step and its gradient reduced whole, as a reduce-scatter
    plus the all-gather: the same bytes as an all-reduce)."""
    shape = tuple(int(d) for d in variable.shape)
    if distribution is None or not hasattr(distribution, "device_mesh"):
        return shape
    layout = distribution.get_variable_layout(variable)
    axes = getattr(layout, "axes", None)
    if not axes:
        return shape
    mesh = distribution.device_mesh
    sizes = dict(zip(mesh.axis_names, mesh.shape))
    data_axis = getattr(distribution, "batch_dim_name", None)
    local = []
    for dim, names in zip(shape, axes):
        names = names if isinstance(names, (tuple, list)) else (names,)
        split = math.prod(
            sizes[n] for n in names if n is not None and n != data_axis
        )
        local.append(dim // split)
    return tuple(local)


def _entries(model_or_sizes: Any) -> list:
    """(shape, dtype name or None) per trainable tensor."""
    argument = "model_or_sizes"
    if isinstance(model_or_sizes, numbers.Integral) and not isinstance(
        model_or_sizes, bool
    ):
        return [((check_int(model_or_sizes, argument, minimum=0),), None)]
    variables = getattr(model_or_sizes, "trainable_variables", None)
    if variables is None:
        if isinstance(model_or_sizes, (str, bytes)) or not isinstance(
            model_or_sizes, Sequence
        ):
            raise TypeError(
                f"Argument `{argument}` must be a Keras model, a list of "
                "variables, element counts (ints) or shapes (tuples), or one "
                f"int (the parameter count). Received: {argument}="
                f"{model_or_sizes!r} (of type {type(model_or_sizes).__name__})"
            )
        variables = list(model_or_sizes)
    distribution = None
    if backend() == "jax":
        import keras

        distribution = keras.distribution.distribution()
    entries = []
    for item in variables:
        if isinstance(item, numbers.Integral) and not isinstance(item, bool):
            entries.append(((check_int(item, argument, minimum=0),), None))
        elif isinstance(item, (tuple, list)):
            entries.append((tuple(check_int(d, argument) for d in item), None))
        elif hasattr(item, "shape") and hasattr(item, "dtype"):
            dtype = getattr(item.dtype, "name", item.dtype)
            entries.append((_local_shape(item, distribution), str(dtype)))
        else:
            raise TypeError(
                f"Argument `{argument}` must hold variables, ints or shapes."
                f" Received an element {item!r} (of type "
                f"{type(item).__name__})"
            )
    return entries


def _compressed(entries: list, compression: Any, dtype: Any) -> tuple:
    """(payload bytes, collectives per reduction, wire) under a
    `keras_mgpu.compression` method (read by its `method`, so this module
    imports no compression code: it runs on TensorFlow only)."""
    method = getattr(compression, "method", None)
    if method in ("float16", "bfloat16"):
        payload = sum(2 * math.prod(shape) for shape, _ in entries)
        if method == "float16":
            # One float32 bound per tensor, summed before the payload so
            # that the scaled float16 sum cannot overflow.
            return payload + 4 * len(entries), 2, "float16 (scaled)"
        return payload, 1, "bfloat16"
    if method == "power_sgd":
        payload = 0
        for shape, name in entries:
            size = _element_bytes(dtype or name or "float32")
            matrix = compression.matrix_shape(shape)
            if matrix is None:  # sent whole
                payload += size * math.prod(shape)
            else:  # the P (n x r) and Q (m x r) factors, float32 or 64
                factor = 8 if size == 8 else 4
                payload += factor * (matrix[0] + matrix[1]) * compression.rank
        return payload, 2, f"power_sgd rank {compression.rank}"
    raise ValueError(
        f"Cannot size the compression method {compression!r} (known: "
        "'float16', 'bfloat16', PowerSGD). Pass `model_or_sizes` and "
        "`dtype` that describe what it sends."
    )


def update_bytes(
    model_or_sizes: Any,
    *,
    optimizer: Any = None,
    dtype: Any = None,
) -> UpdateTraffic:
    """Bytes each device sends and receives per optimizer update for the
    data-parallel gradient reduction.

    The payload of one reduction is the sum over trainable variables of
    their size times the bytes of the dtype the reduction runs in, counted
    for the part of each variable one device holds:

    - **TensorFlow** (`tf.distribute`): every replica all-reduces the whole
      gradient in its variable's dtype (float32 also under
      `mixed_float16`: variables stay float32). With
      `keras_mgpu.GradientAccumulationOptimizer` the window's mean crosses
      **once per update**; its `compression` changes the payload:
      "float16" / "bfloat16" 2 bytes per element (float16 plus one float32
      bound per tensor, in a second collective), `PowerSGD(rank=r)` the
      `(n + m)·r` factor elements of each compressed `n × m` matrix (two
      collectives; tensors it leaves alone cross whole; before
      `start_after_updates` everything crosses whole, which this does not
      model).
    - **JAX** (`keras.distribution`): XLA reduces the gradients inside the
      compiled step, before any optimizer sees them, so with accumulation
      over `K` micro-steps the payload crosses **K times per update**
      (once per `fit` step; Keras's built-in `gradient_accumulation_steps`
      does the same on both backends). Under `ModelParallel` a device
      reduces only its shard of each variable over the data axis: a
      dimension split over a non-batch mesh axis counts `1/size` of it.
      `train_step_collectives` reads the same numbers from the compiled
      step.

    Scalar reductions (the loss, metrics, the finiteness count) are left
    out: a few bytes per step. A ring all-reduce makes each device send,
    and receive, `2(N-1)/N` of the payload (`UpdateTraffic.wire_bytes`).

    Args:
        model_or_sizes: a Keras model (its `trainable_variables`), a list
            of variables, of element counts (ints) or shapes (tuples), or
            one int (the parameter count).
        optimizer: the optimizer that applies the gradients (default: the
            model's `optimizer`, if any); wrappers (`LossScaleOptimizer`,
            `GradientAccumulationOptimizer`) are looked through.
        dtype: the dtype gradients cross in when no compression method
            sets it (default: each variable's dtype; "float32" for sizes).

    Returns:
        An `UpdateTraffic`.

    Example:

    ```python
    import keras_mgpu

    traffic = keras_mgpu.monitoring.update_bytes(25_557_032)  # ResNet-50
    assert traffic.bytes_per_update == 4 * 25_557_032
    print(traffic.wire_bytes(8) / 1e6, "MB sent per device per update")
    ```
    """
    entries = _entries(model_or_sizes)
    if dtype is not None:
        _element_bytes(dtype)
    if optimizer is None:
        optimizer = getattr(model_or_sizes, "optimizer", None)
    window, compression, once = _accumulation(_unwrap(optimizer))
    parameters = sum(math.prod(shape) for shape, _ in entries)
    if compression is not None:
        if dtype is not None:
            raise ValueError(
                "Arguments `dtype` and an optimizer with `compression` "
                "conflict: the compression method sets the wire dtype. "
                f"Received: dtype={dtype!r}, compression={compression!r}"
            )
        payload, rounds, wire = _compressed(entries, compression, dtype)
    else:
        payload = sum(
            _element_bytes(dtype or name or "float32") * math.prod(shape)
            for shape, name in entries
        )
        names = {str(dtype or name or "float32") for _, name in entries}
        rounds, wire = 1, "+".join(sorted(names)) or "float32"
    reductions = 1 if once else window
    return UpdateTraffic(
        parameters=parameters,
        payload_bytes=payload,
        reductions_per_update=reductions,
        bytes_per_update=payload * reductions,
        micro_steps_per_update=window,
        collectives_per_reduction=rounds,
        wire=wire,
    )


def _bandwidth(value: Any, argument: str, allow_none: bool = False) -> Any:
    if value is None and allow_none:
        return None
    if isinstance(value, str):
        if value not in INTERCONNECTS:
            raise ValueError(
                f"Argument `{argument}` must be a number of GB/s > 0 or one "
                f"of {', '.join(repr(k) for k in INTERCONNECTS)}. Received: "
                f"{argument}={value!r}"
            )
        return INTERCONNECTS[value]
    return check_number(value, argument, minimum=0.0, exclusive_minimum=True)


def predict_scaling(
    *,
    step_seconds: float,
    bytes_per_update: Any,
    devices: int,
    hosts: int = 1,
    intra_host_gbps: Any,
    inter_host_gbps: Any = None,
    overlap: bool = False,
    latency_seconds: float = 0.0,
) -> ScalingPrediction:
    """Predicted time per update and scaling efficiency of data-parallel
    training on `devices` devices spread evenly over `hosts` hosts.

    The model (bandwidth-bound, as NCCL's and XLA's ring and hierarchical
    all-reduces are for gradients of megabytes), with `B` the payload per
    update, `G = devices / hosts` devices per host and `α` the latency of
    one ring step:

    - one host: a ring all-reduce over the `G` devices, each sending
      `2(G-1)/G · B` over its link: `2(G-1)/G · B / intra + 2(G-1)·α`;
    - several hosts, hierarchically (NCCL's, Horovod's hierarchical
      all-reduce): reduce-scatter inside each host, a ring all-reduce of
      the shards across hosts (the `G` shards of a host together `B`,
      through the host's network), all-gather inside each host:
      `2(G-1)/G · B / intra + 2(H-1)/H · B / inter + 2(G-1+H-1)·α`.
      `inter_host_gbps` is what one host sends per direction in all (the
      sum of its ports);
    - time per update: compute plus communication, or the larger of the
      two with `overlap=True` (gradients reduced while the backward pass
      still runs: a lower bound on the time);
    - efficiency: `step_seconds / update_seconds` (weak scaling: the same
      per-device batch).

    With `devices=1` nothing crosses: the prediction is `step_seconds`
    exactly.

    Args:
        step_seconds: seconds per update on one device (> 0), measured.
        bytes_per_update: bytes each device reduces per update (>= 0), or
            an `UpdateTraffic` (its `bytes_per_update`).
        devices: int >= 1, devices in all (a multiple of `hosts`).
        hosts: int >= 1 (default 1).
        intra_host_gbps: GB/s (bytes, per direction) between devices of a
            host, or a key of `INTERCONNECTS` ("nvlink4", "pcie4_x16", ...).
        inter_host_gbps: GB/s (bytes, per direction) one host sends to the
            network, or a key of `INTERCONNECTS` ("network_400gbit", ...);
            required when `hosts > 1`. Network links are quoted in Gb/s:
            divide by 8.
        overlap: bool (default False).
        latency_seconds: seconds per ring step (default 0: bandwidth
            only). NCCL's per-step latency is a few microseconds; at 512
            devices on one flat ring that is ~1000 steps.

    Returns:
        A `ScalingPrediction`.

    Example:

    ```python
    from keras_mgpu.monitoring import predict_scaling

    p = predict_scaling(
        step_seconds=0.25,
        bytes_per_update=4 * 25_557_032,
        devices=64,
        hosts=8,
        intra_host_gbps="nvlink4",
        inter_host_gbps=8 * 50.0,
    )
    print(f"{p.efficiency:.1%}")
    ```
    """
    step = check_number(
        step_seconds, "step_seconds", minimum=0.0, exclusive_minimum=True
    )
    payload = getattr(bytes_per_update, "bytes_per_update", bytes_per_update)
    payload = check_number(payload, "bytes_per_update", minimum=0.0)
    devices = check_int(devices, "devices", minimum=1)
    hosts = check_int(hosts, "hosts", minimum=1)
    if devices % hosts:
        raise ValueError(
            "Argument `devices` must be a multiple of `hosts` (the same "
            f"number of devices on every host). Received: devices={devices}"
            f", hosts={hosts}"
        )
    intra = _bandwidth(intra_host_gbps, "intra_host_gbps")
    inter = _bandwidth(inter_host_gbps, "inter_host_gbps", allow_none=True)
    if hosts > 1 and inter is None:
        raise ValueError(
            "Argument `inter_host_gbps` is required with several hosts. "
            f"Received: inter_host_gbps=None, hosts={hosts}"
        )
    overlap = check_bool(overlap, "overlap")
    latency = check_number(latency_seconds, "latency_seconds", minimum=0.0)
    per_host = devices // hosts
    intra_bytes = 2.0 * (per_host - 1) / per_host * payload
    inter_bytes = 2.0 * (hosts - 1) / hosts * payload
    communication = 0.0
    if per_host > 1:
        communication += intra_bytes / (intra * _GB)
        communication += 2 * (per_host - 1) * latency
    if hosts > 1:
        communication += inter_bytes / (inter * _GB)
        communication += 2 * (hosts - 1) * latency
    update = max(step, communication) if overlap else step + communication
    efficiency = step / update
    return ScalingPrediction(
        devices=devices,
        hosts=hosts,
        step_seconds=step,
        communication_seconds=communication,
        update_seconds=update,
        efficiency=efficiency,
        speedup=devices * efficiency,
        intra_host_bytes=intra_bytes,
        inter_host_bytes=inter_bytes,
    )


def train_step_collectives(
    model: Any, x: Any, y: Any = None, sample_weight: Any = None
) -> dict:
    """The collectives of the model's compiled train step (JAX), from
    XLA's HLO text: `collective_bytes_from_hlo` of the step `fit` runs for
    this global batch under the `keras.distribution` in force. Compiles
    the step once (nothing runs); the model and optimizer must be built.

    Under `DataParallel` the all-reduce bytes are the gradients' bytes plus
    the loss's and metrics' scalar sums (`"scalar"`); under `ModelParallel`
    the activations' collectives come on top.

    Example:

    ```python
    import numpy as np
    import keras
    import keras_mgpu

    model = keras.Sequential([keras.Input((8,)), keras.layers.Dense(4)])
    model.compile(optimizer="sgd", loss="mse")
    x, y = np.zeros((16, 8), "float32"), np.zeros((16, 4), "float32")
    model.train_on_batch(x, y)
    counts = keras_mgpu.monitoring.train_step_collectives(model, x, y)
    ```
    """
    require_backend("train_step_collectives", ("jax",))
    from keras_mgpu.backend.jax.collectives import compiled_train_step

    compiled = compiled_train_step(model, x, y, sample_weight)
    return collective_bytes_from_hlo(compiled.as_text())

"""`plan_memory`: one call that picks how to train a model within a memory
budget per device, on Keras 3's JAX backend.

The knobs keras_mgpu has, and what each costs: accumulation (the batch of an
update split into K micro-batches: activations for 1/K of it, one more copy
of the gradients, K dispatches), recompute (`apply_recompute`'s policies:
fewer activations kept, one more forward of what is recomputed), offload
(what recompute keeps moved to host memory: two host transfers of it) and
the optimizer state split over the data axis (`shard_optimizer_state`:
1/N of it, nothing more sent). For each combination the planner reads, from
the programs JAX builds for the model (shapes only, nothing runs on the
device):

- activations: the most bytes of intermediate values alive at once in the
  gradient program run in order (`recompute_memory.backward_peak_bytes`,
  offloaded values excluded), at the micro-batch one device computes;
- host bytes: the residuals kept in host memory (offload);
- FLOPs: XLA's cost analysis of the lowered gradient program (recompute
  included);
- weights, optimizer state, gradients and accumulators: from the variables
  (their shards, under a `keras.distribution`).

and estimates the time of one update: FLOPs / the device's dense peak +
host transfers / `host_bandwidth_gbps` + K x `dispatch_ms`. Of the
combinations that fit, the fastest is chosen (at equal time, the one that
changes least). The estimate of activations is a static reading of the
program; XLA may fuse and reorder (on a GPU it tracks the allocator's peak,
docs/guides/gradient-checkpointing.md); confirm with `MemoryMonitor` on the
device.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from keras_mgpu._validation import check_int, check_number

MB = 1024.0 * 1024.0
POLICIES = ("none", "per_layer", "sqrt", "min_memory", "selective")
DEFAULT_POLICIES = ("none", "per_layer", "min_memory", "selective")
DEFAULT_ACCUMULATION = (1, 2, 4, 8, 16)
# A CPU has no entry in the peak table: a nominal figure, so that times are
# comparable between candidates (the report says so).
NOMINAL_PEAK_FLOPS = 1e12


@dataclasses.dataclass
class MemoryCandidate:
    """One combination the planner considered.

    Attributes:
        accumulation_steps: K micro-batches per update.
        micro_batch_size: the global micro-batch (`fit`'s `batch_size`).
        policy: the recompute policy ("none": no recompute).
        offload: whether what recompute keeps lives in host memory.
        shard_state: whether the optimizer state is split over the data
            axis.
        memory_mb: estimated bytes per device (MiB): `parts_mb` summed.
        parts_mb: weights, optimizer state, gradients, accumulators,
            batch, activations (MiB per device).
        host_mb: bytes kept in host memory per device per micro-step (MiB).
        flops: FLOPs of one update per device (recompute included).
        time_ms: estimated time of one update (ms).
        fits: `memory_mb <= memory_budget_mb`.
        error: why the combination could not be applied (then not chosen).
    """

    accumulation_steps: int
    micro_batch_size: int
    policy: str
    offload: bool
    shard_state: bool
    memory_mb: float = float("nan")
    parts_mb: dict = dataclasses.field(default_factory=dict)
    host_mb: float = 0.0
    flops: float = float("nan")
    time_ms: float = float("nan")
    fits: bool = False
    error: str | None = None

    def describe(self) -> str:
        knobs = [f"K={self.accumulation_steps}"]
        knobs.append("no recompute" if self.policy == "none" else self.policy)
        if self.offload:
            knobs.append("offload")
        if self.shard_state:
            knobs.append("state sharded")
        return ", ".join(knobs)

    def changes(self) -> int:
        """How many knobs differ from plain training (the tie-break)."""
        return (
            (self.accumulation_steps > 1)
            + (self.policy != "none")
            + self.offload
            + self.shard_state
        )


@dataclasses.dataclass
class MemoryPlan:
    """What `plan_memory` chose, and every candidate it considered.

    Attributes:
        chosen: the candidate to train with (the fastest that fits; when
            none fits, the one that needs least, with `fits` False).
        candidates: every combination, in the order considered.
        memory_budget_mb: the budget per device.
        global_batch_size: examples per update.
        data_parallel: the devices the batch is split over.
        peak_flops: the FLOP/s the times assume (`nominal_peak` True when
            it is a nominal figure for a device not in the table).
    """

    chosen: MemoryCandidate
    candidates: list
    memory_budget_mb: float
    global_batch_size: int
    data_parallel: int
    peak_flops: float
    nominal_peak: bool
    layers: Any = None

    @property
    def fits(self) -> bool:
        return self.chosen.fits

    @property
    def batch_size(self) -> int:
        """The `batch_size` to pass to `fit` (the global micro-batch)."""
        return self.chosen.micro_batch_size

    def apply(self, model: Any) -> Any:
        """Set `model` up as planned and return it: recompute (and offload)
        switched in place, the optimizer wrapped in
        `GradientAccumulationOptimizer(K)` (the model compiled again with
        its own loss and metrics) when K > 1, and the optimizer state split
        over the data axis when planned. Call it under the distribution
        the model trains with; train with `fit(..., batch_size=
        plan.batch_size)`."""
        from keras_mgpu.layers import apply_recompute, strip_recompute
        from keras_mgpu.optimizers import GradientAccumulationOptimizer
        from keras_mgpu.sharding import shard_optimizer_state

        chosen = self.chosen
        strip_recompute(model)
        if chosen.policy != "none":
            apply_recompute(
                model,
                self.layers,
                policy=chosen.policy,
                offload=chosen.offload,
            )
        if chosen.accumulation_steps > 1:
            _recompile(
                model,
                GradientAccumulationOptimizer(
                    model.optimizer, chosen.accumulation_steps
                ),
            )
        if chosen.shard_state:
            shard_optimizer_state(model)
        return model

    def to_dict(self) -> dict:
        return {
            "chosen": dataclasses.asdict(self.chosen),
            "candidates": [dataclasses.asdict(c) for c in self.candidates],
            "memory_budget_mb": self.memory_budget_mb,
            "global_batch_size": self.global_batch_size,
            "data_parallel": self.data_parallel,
            "peak_flops": self.peak_flops,
            "nominal_peak": self.nominal_peak,
        }

    def __str__(self) -> str:
        chosen = self.chosen
        head = (
            f"MemoryPlan: {chosen.describe()}, batch_size="
            f"{chosen.micro_batch_size} (global {self.global_batch_size}, "
            f"{self.data_parallel} data-parallel devices): "
            f"{chosen.memory_mb:.1f} MiB per device of "
            f"{self.memory_budget_mb:g}"
            + ("" if chosen.fits else " -- NOTHING FITS")
        )
        unit = "nominal ms" if self.nominal_peak else "ms"
        lines = [head, f"  {'candidate':<44} {'MiB':>9} {unit:>11}  fits"]
        for c in self.candidates:
            if c.error:
                lines.append(
                    f"  {c.describe():<44} {'-':>9} {'-':>11}  ({c.error})"
                )
                continue
            lines.append(
                f"  {c.describe():<44} {c.memory_mb:9.2f} {c.time_ms:11.3f}"
                f"  {'yes' if c.fits else 'no'}"
            )
        return "\n".join(lines)

    __repr__ = __str__


def _recompile(model: Any, optimizer: Any) -> None:
    """`model.compile` again with `optimizer` and the rest of its compile
    arguments (Keras 3.15 keeps them, as given, in the private
    `_compile_config`)."""
    config = dict(model._compile_config.config)
    config["optimizer"] = optimizer
    model.compile(**config)


def _leaves(data: Any) -> list:
    import keras

    return [np.asarray(leaf) for leaf in keras.tree.flatten(data)]


def _take(data: Any, count: int) -> Any:
    import keras

    return keras.tree.map_structure(lambda a: np.asarray(a)[:count], data)


def _per_device_bytes(variables: Sequence[Any]) -> int:
    """Bytes of `variables` the fullest device holds (their shards), or
    their whole size when they are not laid out on devices."""
    from keras_mgpu.backend.jax.variables import bytes_per_device

    total = sum(
        int(np.prod(v.shape, dtype=np.int64)) * np.dtype(v.dtype).itemsize
        for v in variables
    )
    return max(bytes_per_device(variables).values(), default=total)


def _loss_of(model: Any) -> Any:
    import keras

    loss = getattr(model, "loss", None)
    if isinstance(loss, str) or callable(loss):
        function = keras.losses.get(loss)
        return lambda y_true, y_pred: keras.ops.mean(function(y_true, y_pred))
    return None  # recompute_memory's default (mean squared error)


def _peak(model: Any, peak_flops: float | None) -> tuple[float, bool]:
    if peak_flops is not None:
        return float(peak_flops), False
    import jax

    from keras_mgpu.monitoring.device_peaks import peak_flops as table

    device = jax.devices()[0]
    kind = "cpu" if device.platform == "cpu" else device.device_kind
    found = table(kind, getattr(model, "compute_dtype", "float32"))
    if found is None:
        return NOMINAL_PEAK_FLOPS, True
    return float(found), False


def _measure(model, x, y, loss, per_device: Sequence[int]) -> dict:
    """Activations (device bytes), host bytes and FLOPs of one micro-step
    at each per-device batch in `per_device` (shapes only)."""
    import jax

    from keras_mgpu.backend.jax import recompute_memory

    def step(trainable, non_trainable, inputs, targets):
        y_pred, _ = model.stateless_call(
            trainable, non_trainable, inputs, training=True
        )
        if loss is None:
            return jax.numpy.mean(jax.numpy.square(y_pred - targets))
        return loss(targets, y_pred)

    values = (
        [v.value for v in model.trainable_variables],
        [v.value for v in model.non_trainable_variables],
    )
    found = {}
    for m in per_device:
        xs, ys = _take(x, m), _take(y, m)
        peak = recompute_memory.backward_peak_bytes(step, *values, xs, ys)
        host = recompute_memory.residual_bytes(
            step, *values, xs, ys, memory="host"
        )
        grad = jax.grad(step, argnums=(0,))
        lowered = jax.jit(grad).lower(*values, xs, ys)
        analysis = lowered.cost_analysis()
        if isinstance(analysis, (list, tuple)):
            analysis = analysis[0]
        flops = float((analysis or {}).get("flops", 0.0))
        found[m] = (peak, host, flops)
    return found


def _linear(points: dict, m: int, index: int) -> float:
    """`points[m][index]`, or the line through the two measured sizes."""
    if m in points:
        return float(points[m][index])
    (m0, v0), (m1, v1) = sorted(
        (k, float(v[index])) for k, v in points.items()
    )[:2]
    return v0 + (v1 - v0) * (m - m0) / (m1 - m0)


def plan_memory(
    model: Any,
    data: tuple,
    memory_budget_mb: float,
    *,
    global_batch_size: int | None = None,
    layers: Any = None,
    policies: Sequence[str] = DEFAULT_POLICIES,
    accumulation_steps: Sequence[int] = DEFAULT_ACCUMULATION,
    offload: bool = True,
    shard_state: bool = True,
    peak_flops: float | None = None,
    host_bandwidth_gbps: float = 25.0,
    dispatch_ms: float = 0.5,
) -> MemoryPlan:
    """Choose accumulation, recompute, offload and optimizer-state
    sharding so that training `model` fits `memory_budget_mb` per device,
    at the best estimated speed.

    Keras 3 on JAX (on TensorFlow a `BackendNotSupportedError`, naming
    `configure_batch` and `apply_recompute` there). Every combination of
    `accumulation_steps` (those that split the global batch evenly over the
    data-parallel devices), `policies`, offload (with a recompute policy,
    when `offload`) and state sharding (when `shard_state` and the
    distribution in force has more than one data-parallel device) is read
    from the programs JAX builds for the model (module docstring): memory
    per device and time per update. Nothing is compiled or run on the
    device; the model's recompute switches are set and removed while it
    reads them, and it is left as it was.

    Args:
        model: a built model compiled with a plain optimizer (not yet
            wrapped in `GradientAccumulationOptimizer`; the plan chooses
            accumulation) and no recompute applied.
        data: `(x, y)` arrays (nests allowed): at least one micro-batch
            per device of samples; their first dimension is the global
            batch unless `global_batch_size` is given.
        memory_budget_mb: float > 0, MiB per device.
        global_batch_size: int, examples per update (default: `len(x)`).
        layers: which layers recompute chooses (as `apply_recompute`'s
            `layers`; default: the model's top level).
        policies: recompute policies to consider, among "none",
            "per_layer", "sqrt", "min_memory", "selective".
        accumulation_steps: the K to consider.
        offload: bool, also consider offload with each policy.
        shard_state: bool, also consider splitting the optimizer state
            over the data axis (with a data-parallel distribution).
        peak_flops: FLOP/s of one device (default: the table of
            `ThroughputMonitor` for the device and the model's compute
            dtype; a CPU gets a nominal 1e12, for comparison only).
        host_bandwidth_gbps: GB/s between device and host memory, each
            way (default 25: PCIe 4 x16 in practice).
        dispatch_ms: the host's cost of one more micro-step (ms).

    Returns:
        A `MemoryPlan`: `plan.apply(model)`, then
        `fit(..., batch_size=plan.batch_size)`; `print(plan)` lists every
        candidate.

    Example:

    ```python
    with keras.distribution.DataParallel().scope():
        model = build()
        model.compile(keras.optimizers.Adam(1e-3), "mse")
        plan = keras_mgpu.plan_memory(model, (x[:256], y[:256]),
                                      memory_budget_mb=2048)
        print(plan)
        plan.apply(model)
        model.fit(x, y, batch_size=plan.batch_size)
    ```
    """
    import keras

    from keras_mgpu.backend import require_backend
    from keras_mgpu.backend.jax.distribution import data_parallel_size
    from keras_mgpu.layers import (
        apply_recompute,
        recomputed_layers,
        strip_recompute,
    )
    from keras_mgpu.optimizers import GradientAccumulationOptimizer

    require_backend(
        "plan_memory",
        ("jax",),
        instead="keras_mgpu.configure_batch and keras_mgpu.apply_recompute",
    )
    if not isinstance(model, keras.Model):
        raise TypeError(
            "Argument `model` must be a keras.Model. Received: "
            f"model of type {type(model).__name__}"
        )
    optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        raise ValueError(
            "Argument `model` must be compiled (`model.compile(optimizer, "
            f"loss)`). Received: model={model.name!r} without an optimizer"
        )
    if isinstance(optimizer, GradientAccumulationOptimizer):
        raise ValueError(
            "Compile `model` with its plain optimizer: the plan chooses "
            "the accumulation. Received: a GradientAccumulationOptimizer("
            f"accumulation_steps={optimizer.accumulation_steps})"
        )
    if recomputed_layers(model):
        raise ValueError(
            "Argument `model` has layers recomputed already; the plan "
            "chooses the policy: call `keras_mgpu.strip_recompute(model)` "
            "first."
        )
    memory_budget_mb = check_number(
        memory_budget_mb, "memory_budget_mb", minimum=0.0
    )
    if memory_budget_mb <= 0:
        raise ValueError(
            "Argument `memory_budget_mb` must be > 0. Received: "
            f"memory_budget_mb={memory_budget_mb}"
        )
    if not isinstance(data, tuple) or len(data) != 2:
        raise TypeError(
            "Argument `data` must be a tuple `(x, y)`. Received: "
            f"data of type {type(data).__name__}"
        )
    x, y = data
    samples = len(_leaves(x)[0])
    if global_batch_size is None:
        global_batch_size = samples
    global_batch_size = check_int(
        global_batch_size, "global_batch_size", minimum=1
    )
    unknown = [p for p in policies if p not in POLICIES]
    if not policies or unknown:
        raise ValueError(
            f"Argument `policies` must be a non-empty list of {POLICIES}. "
            f"Received: policies={tuple(policies)!r}"
        )
    steps = [
        check_int(k, "accumulation_steps", minimum=1)
        for k in accumulation_steps
    ]
    check_number(host_bandwidth_gbps, "host_bandwidth_gbps", minimum=0.0)
    check_number(dispatch_ms, "dispatch_ms", minimum=0.0)

    n = data_parallel_size()
    steps = sorted(
        k
        for k in set(steps)
        if global_batch_size % k == 0 and (global_batch_size // k) % n == 0
    )
    if not steps:
        raise ValueError(
            f"No value of `accumulation_steps` splits global_batch_size="
            f"{global_batch_size} into equal micro-batches over {n} "
            f"data-parallel devices. Received: accumulation_steps="
            f"{tuple(accumulation_steps)!r}"
        )
    per_device_sizes = sorted({global_batch_size // k // n for k in steps})
    # Only the smallest and largest are traced: the rest lie on the line
    # through them (activations, host bytes and FLOPs grow with the batch).
    traced = sorted({per_device_sizes[0], per_device_sizes[-1]})
    if traced[-1] > samples:
        raise ValueError(
            f"Argument `data` has {samples} samples; reading one device's "
            f"micro-batch at K={steps[0]} needs {traced[-1]}. Pass more "
            "samples or a smaller `global_batch_size`."
        )
    if not optimizer.built:
        optimizer.build(model.trainable_variables)
    peak, nominal = _peak(model, peak_flops)
    loss = _loss_of(model)

    weights = _per_device_bytes(model.weights)
    trainable = _per_device_bytes(model.trainable_variables)
    state = _per_device_bytes(optimizer.variables)
    sample_bytes = sum(leaf[0].nbytes for leaf in _leaves(x) + _leaves(y))
    shardings = (False, True) if shard_state and n > 1 else (False,)
    choices = []
    for policy in policies:
        for off in (False, True) if offload and policy != "none" else (False,):
            choices.append((policy, off))

    candidates = []
    for policy, off in choices:
        measured, error = None, None
        try:
            if policy != "none":
                apply_recompute(model, layers, policy=policy, offload=off)
            measured = _measure(model, x, y, loss, traced)
        except (ValueError, TypeError) as exc:
            error = str(exc).split("\n")[0][:160]
        finally:
            strip_recompute(model)
        for k in steps:
            for shard in shardings:
                m = global_batch_size // k // n
                c = MemoryCandidate(
                    accumulation_steps=k,
                    micro_batch_size=m * n,
                    policy=policy,
                    offload=off,
                    shard_state=shard,
                )
                candidates.append(c)
                if measured is None:
                    c.error = error
                    continue
                activations = _linear(measured, m, 0)
                host = _linear(measured, m, 1)
                flops = _linear(measured, m, 2)
                divide = n if shard else 1
                c.parts_mb = {
                    "weights": weights / MB,
                    "optimizer_state": state / divide / MB,
                    "gradients": trainable / MB,
                    "accumulators": (trainable / divide if k > 1 else 0) / MB,
                    "batch": sample_bytes * m / MB,
                    "activations": activations / MB,
                }
                c.memory_mb = sum(c.parts_mb.values())
                c.host_mb = host / MB
                c.flops = flops * k
                transfer = 2 * host * k / (host_bandwidth_gbps * 1e9 or 1)
                c.time_ms = 1e3 * (c.flops / peak + transfer) + k * dispatch_ms
                c.fits = c.memory_mb <= memory_budget_mb

    usable = [c for c in candidates if c.error is None]
    if not usable:
        raise ValueError(
            "No combination could be read for this model: "
            + "; ".join(sorted({c.error for c in candidates if c.error}))
        )
    fitting = [c for c in usable if c.fits]
    if fitting:
        fastest = min(c.time_ms for c in fitting)
        close = [c for c in fitting if c.time_ms <= fastest * 1.01]
        chosen = min(close, key=lambda c: (c.changes(), c.time_ms))
    else:
        chosen = min(usable, key=lambda c: c.memory_mb)
    return MemoryPlan(
        chosen=chosen,
        candidates=candidates,
        memory_budget_mb=float(memory_budget_mb),
        global_batch_size=global_batch_size,
        data_parallel=n,
        peak_flops=peak,
        nominal_peak=nominal,
        layers=layers,
    )


__all__ = ["MemoryCandidate", "MemoryPlan", "plan_memory"]

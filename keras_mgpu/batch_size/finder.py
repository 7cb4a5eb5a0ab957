"""`find_batch_size`: the largest per-replica batch whose training step fits
a memory budget, measured on a copy of the model."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import numpy as np

from keras_mgpu import backend
from keras_mgpu._flavour import tf
from keras_mgpu._validation import check_at_most_one, check_int, check_number
from keras_mgpu.backend import require_backend
from keras_mgpu.batch_size import memory_probe as probe_module
from keras_mgpu.batch_size._settings import ProbeSettings
from keras_mgpu.batch_size.result import (
    MB,
    MIN_SAFETY_MARGIN,
    BatchSizeResult,
    _explained,
)
from keras_mgpu.batch_size.samples import SampleBatches
from keras_mgpu.batch_size.search import (
    DEFAULT_MAX_TRIALS,
    SearchOutcome,
    search_batch_size,
)
from keras_mgpu.distribute import current_strategy, worker_info
from keras_mgpu.distribute.collectives import gather_rows

DEFAULT_MEMORY_FRACTION = 0.9
# The safety margin: the part of the budget the answer's measured peak
# keeps free, for how much higher a training run's step peaks go than the
# probe measured. The peak of one batch size varies from step to step on
# CPU with oneDNN (TensorFlow's BFC allocator hands a request a whole free
# chunk unless it is at least twice the request, so the bytes counted
# depend on the order in which threads freed buffers), and the longer the
# run, the higher its highest step (200 steps of `fit` peaked 4% above
# their first 30). What varies are mostly the step's batch-sized buffers,
# not the weights and optimizer state, so a margin of the whole budget
# (the former fixed 20%) costs most where the fixed part is large: it kept
# the answer at 0.65 of the largest batch that fits in a fresh process on
# the wide MLP of issue 19, and at 0.3 on a model whose fixed part is 70%
# of the budget (issue 31). By default (`safety_margin=None`) the margin
# is derived from the answer's confirmation (12 steps,
# `memory_probe.CONFIRM_STEPS`): the largest of `SPREAD_FACTOR` times how
# far its highest step stood above its median one (a longer run draws
# more such steps), `VARIABLE_SHARE` of the batch-dependent part of its
# peak (the peak less the fitted line's fixed part) and
# `MIN_SAFETY_MARGIN` of the budget; at most `MAX_SAFETY_MARGIN`. The
# search probes against the budget less `MIN_SAFETY_MARGIN`; a
# confirmation that calls for more holds the search to the lower budget
# and steps the answer down. Measured (2-core VM, oneDNN, loaded): the
# probe's own process reads ~2-5 MB above a fresh process at the same
# batch (its history of larger probes), which the spread partly reflects;
# a small MLP's fresh steps went up to 3 MB above the probe's figure
# (batch 1900, one step in 12). See docs/guides/batch-size.md.
MAX_SAFETY_MARGIN = 0.5
SPREAD_FACTOR = 0.5
VARIABLE_SHARE = 0.1
# An explicit `safety_margin` is a fraction in [0, SAFETY_MARGIN_LIMIT].
SAFETY_MARGIN_LIMIT = 0.5
_LIMITS = ("memory", "max_batch_size", "trials")


def find_batch_size(
    model: Any,
    data: Any,
    *,
    memory_fraction: float | None = None,
    max_batch_size: int | None = None,
    device: str | None = None,
    memory_budget_mb: float | None = None,
    multiple_of: int = 1,
    strategy: tf.distribute.Strategy | None = None,
    max_trials: int = DEFAULT_MAX_TRIALS,
    safety_margin: float | None = None,
    verbose: int = 0,
) -> BatchSizeResult:
    """The largest per-replica batch whose training step fits in memory.

    On TensorFlow it measures run steps; on JAX it reads what XLA's
    compiled step needs (see "On JAX" below).

    Runs real training steps (forward, backward, optimizer update, the
    model's own `train_step`) of a copy of `model` on one device and
    reads TensorFlow's allocator peak (`get_memory_info`) after each: first
    at batch `multiple_of` and twice that, then at the batch a fitted line
    `peak = fixed + per_sample * batch` predicts for the budget, then
    between the largest batch that fits and the smallest that does not
    until they are ~3% apart. An out-of-memory error in a step counts as
    "does not fit": the search backs off. The user's weights, optimizer
    state and random-number state are untouched.

    **Under `tf.distribute`.** The probe runs before training, on one
    device of the strategy (the one with the least memory when GPUs
    differ), outside the strategy's scope. Under
    `MultiWorkerMirroredStrategy` every worker probes its own device and
    all get the smallest answer (one small all-reduce; call it on every
    worker). The result is per replica: each replica's batch.

    **Budget.** `memory_fraction` (default 0.9) of the device's memory: a
    GPU's total (NVML, or its logical `memory_limit`), or on CPU the host
    memory available now. Or an explicit `memory_budget_mb`. Each batch
    size is measured over 3 steps of `fit` (the first, which traces, and
    the steady state, where `fit` holds the next batch during a step), and
    the answer again over 12 (`memory_probe.CONFIRM_STEPS`; stepped down
    where they peak higher): the highest peak must stay within the budget
    less a safety margin, which covers how much higher a training run's
    step peaks go than the probe saw; so must the fitted line's `peak_mb`
    at the answer. The margin is `safety_margin` (a fraction of the
    budget), or by default derived from the confirmation: the largest of
    half how far its highest step peaked above its median step
    (`SPREAD_FACTOR`), 10% of the batch-dependent part of its peak (its
    peak less the fitted line's fixed part, `VARIABLE_SHARE`) and 3% of
    the budget (`MIN_SAFETY_MARGIN`): what varies from step to step are
    mostly batch-sized buffers, not weights and optimizer state. Tested on
    CPU with a model whose fixed part is ~70% of the budget: the answer's
    steps stay within the budget in a fresh process up to TensorFlow's CPU
    allocator noise between processes (once 4.3 MB over a 50 MB budget:
    pass a larger `safety_margin` where a CPU budget is hard), and the
    answer is
    0.45-0.79 of the largest batch that fits there (the search's process
    reads the allocator 2-5 MB high, depending on its history). Pass a larger
    `safety_margin` for long runs on a busy allocator. On CPU, TensorFlow
    keeps
    allocator statistics only with `TF_ENABLE_ONEDNN_OPTS=1` set before it
    starts, and they are process-wide.

    **On JAX.** Nothing runs out of memory to find the answer: the copy's
    `train_step` (the stateless step Keras's JAX trainer jits, state
    donated) is compiled for each candidate batch and not run, and XLA's
    memory analysis gives what one device needs (arguments + outputs -
    donated + temporaries). The need is close to affine in the batch, so a
    few compilations bracket the largest batch within ~3%; a short `fit`
    of the copy at the answer confirms it runs (an out-of-memory error
    there steps it down). The budget is `memory_fraction` (default 0.9)
    of the device's limit (`memory_stats()["bytes_limit"]`, GPU and TPU;
    the smallest over the distribution's devices), or `memory_budget_mb`,
    which is required on CPU (it reports no limit). No safety margin is
    kept (`safety_margin` 0): the compiled need does not vary between
    steps. `strategy` is a `keras.distribution` (default: the one in
    force): the step is compiled for the global batch (per-replica batch
    x the data-parallel size) over its mesh, and the figures are per
    device, so `ModelParallel`'s sharded weights count as they are laid
    out. `device` names a JAX device ("gpu:0") whose limit sets the
    budget.

    Args:
        model: a compiled Keras model (Sequential, Functional, or a subclass
            with `get_config`); it is copied, never trained.
        data: an `x` array (or dict / list of arrays), an `(x, y)` or `(x, y,
            sample_weight)` tuple, or a tf.data.Dataset yielding such
            batches. Its samples are repeated to any batch size.
        memory_fraction: float in (0, 1], or None (0.9 unless
            `memory_budget_mb` is given).
        max_batch_size: int >= 1 or None, the largest batch worth having
            (e.g. the global batch over the replicas).
        device: "GPU:1", "CPU:0", ... or None (chosen from the strategy).
        memory_budget_mb: float > 0 or None, the budget in MB (2**20 bytes).
        multiple_of: int >= 1, the batch is a multiple of it (e.g. 8 on
            GPUs with tensor cores).
        strategy: the training strategy; defaults to the model's. On JAX
            a `keras.distribution.Distribution` (default: the one in
            force).
        max_trials: int >= 3, the most probes of the search (default 16;
            the confirmation of its answer comes on top).
        safety_margin: float in [0, 0.5] or None, the fraction of the
            budget the answer's measured peak keeps free. None (default):
            derived from what the confirmation measures on TensorFlow (see
            above), 0 on JAX. Larger is safer for long runs, smaller gets
            closer to the largest batch that fits.
        verbose: int, 1 prints `explain()` (on the chief).

    Returns:
        A `BatchSizeResult`.

    Raises:
        ValueError: an argument out of range; a budget below what the
            smallest batch needs (with the measured peak); data the model
            cannot train on (with the model's error).
        TypeError: a model that cannot be copied.
        RuntimeError: no allocator statistics on the device (says what to
            set).
        ValueError (JAX): no `memory_budget_mb` on a device that reports
            no limit (CPU).

    Example:

    ```python
    # TF_ENABLE_ONEDNN_OPTS=1 for allocator statistics on CPU.
    model.compile(optimizer="adam", loss="mse")
    result = keras_mgpu.find_batch_size(model, (x, y), memory_budget_mb=512)
    print(result.batch_size, result.fixed_mb, result.per_sample_mb)

    # KERAS_BACKEND=jax: compiled, not run; the batch per device.
    distribution = keras.distribution.DataParallel()
    with distribution.scope():
        model = make_model()
        model.compile(optimizer="adam", loss="mse")
    result = keras_mgpu.find_batch_size(
        model, (x, y), memory_fraction=0.8, strategy=distribution
    )
    ```
    """
    require_backend("find_batch_size")
    return probe_batch_size(
        model,
        data,
        ProbeSettings(
            memory_fraction=memory_fraction,
            max_batch_size=max_batch_size,
            device=device,
            memory_budget_mb=memory_budget_mb,
            multiple_of=multiple_of,
            strategy=strategy,
            max_trials=max_trials,
            verbose=verbose,
            accumulate=False,
            safety_margin=safety_margin,
        ),
    )


def probe_batch_size(
    model: Any, data: Any, settings: ProbeSettings
) -> BatchSizeResult:
    """`find_batch_size` with `settings` (checked here, once for both
    backends), optionally with the copy's optimizer wrapped in
    `GradientAccumulationOptimizer` (`settings.accumulate`, for
    `configure_batch`)."""
    _check_arguments(
        settings.memory_fraction,
        settings.memory_budget_mb,
        settings.max_batch_size,
        settings.multiple_of,
    )
    settings = dataclasses.replace(
        settings,
        safety_margin=check_safety_margin(settings.safety_margin),
        max_trials=check_int(settings.max_trials, "max_trials", minimum=3),
        verbose=check_int(settings.verbose, "verbose", minimum=0),
    )
    if backend.is_jax():
        from keras_mgpu.batch_size.compiled_search import probe_compiled

        return probe_compiled(model, data, settings)
    strategy = current_strategy(
        settings.strategy or getattr(model, "distribute_strategy", None)
    )
    blueprint = probe_module.ModelBlueprint(
        model, accumulate=settings.accumulate
    )
    samples = SampleBatches(data)
    reader = probe_module.memory_reader()
    device = _probe_device(strategy, settings.device, reader)
    budget_mb, source = _budget(
        device, settings.memory_fraction, settings.memory_budget_mb, reader
    )
    search_margin = (
        MIN_SAFETY_MARGIN
        if settings.safety_margin is None
        else settings.safety_margin
    )
    confirm_budget = None
    if settings.safety_margin is None:

        def confirm_budget(measurement, fixed_mb):
            return budget_mb - default_margin_mb(
                measurement, fixed_mb, budget_mb
            )

    start = time.perf_counter()
    try:
        outcome = probe_module.run_in_clean_thread(
            lambda: _search_on_device(
                blueprint,
                samples,
                device,
                reader,
                (
                    budget_mb * (1 - search_margin),
                    settings.max_batch_size,
                    settings.multiple_of,
                    settings.max_trials,
                ),
                confirm_budget,
            )
        )
        error = None
    except Exception as exc:  # shared with the other workers, then raised
        outcome, error = None, exc
    seconds = time.perf_counter() - start
    margin = search_margin
    if outcome is not None and outcome.budget_mb < budget_mb * (
        1 - search_margin
    ):
        margin = 1 - outcome.budget_mb / budget_mb  # the confirmation's
    rows = gather_rows(strategy, _to_row(outcome, budget_mb, seconds, margin))
    if error is not None:
        raise _explained(
            error,
            settings.memory_fraction,
            settings.memory_budget_mb,
            source,
            search_margin,
        )
    failed = [i for i, r in enumerate(rows) if not r[0]]
    if failed:
        raise RuntimeError(
            f"find_batch_size failed on worker(s) {failed}: see their error."
        )
    result = _result(rows, outcome, device, source, blueprint.name)
    if settings.verbose and worker_info(strategy)["is_chief"]:
        print(result.explain())
    return result


def _check_arguments(
    memory_fraction, memory_budget_mb, max_batch_size, multiple_of
) -> None:
    check_number(
        memory_fraction,
        "memory_fraction",
        minimum=0.0,
        exclusive_minimum=True,
        maximum=1.0,
        allow_none=True,
    )
    check_number(
        memory_budget_mb,
        "memory_budget_mb",
        minimum=0.0,
        exclusive_minimum=True,
        allow_none=True,
    )
    check_at_most_one(
        ("memory_fraction", memory_fraction),
        ("memory_budget_mb", memory_budget_mb),
    )
    check_int(max_batch_size, "max_batch_size", minimum=1, allow_none=True)
    check_int(multiple_of, "multiple_of", minimum=1)
    if max_batch_size is not None and max_batch_size < multiple_of:
        raise ValueError(
            f"Argument `max_batch_size` must be >= `multiple_of` "
            f"({multiple_of}). Received: max_batch_size={max_batch_size}"
        )


def check_safety_margin(safety_margin: Any) -> float | None:
    """`safety_margin` as a float in [0, `SAFETY_MARGIN_LIMIT`], or None;
    a ValueError (TypeError) naming it, the value and the range."""
    return check_number(
        safety_margin,
        "safety_margin",
        minimum=0.0,
        maximum=SAFETY_MARGIN_LIMIT,
        allow_none=True,
    )


def default_margin_mb(
    measurement: Any, fixed_mb: float, budget_mb: float
) -> float:
    """The default safety margin (MB) for a confirmation `measurement`
    (its peak and step `spread`, see `memory_probe.step_spread`) whose
    fitted line has `fixed_mb` there: `SPREAD_FACTOR` x the spread, at
    least `VARIABLE_SHARE` of the batch-dependent part of the peak, within
    [`MIN_SAFETY_MARGIN`, `MAX_SAFETY_MARGIN`] of the budget."""
    variable = max(measurement.peak_mb - fixed_mb, 0.0)
    wanted = max(
        SPREAD_FACTOR * (measurement.spread or 0.0),
        VARIABLE_SHARE * variable,
    )
    return min(
        max(wanted, MIN_SAFETY_MARGIN * budget_mb),
        MAX_SAFETY_MARGIN * budget_mb,
    )


def _search_on_device(
    blueprint,
    samples,
    device,
    reader,
    search_arguments: tuple,
    confirm_budget=None,
) -> SearchOutcome:
    """The search, in the probe thread: build the copy, step, clean up.
    `search_arguments`: budget, cap, multiple_of, max_trials;
    `confirm_budget`: see `search_batch_size`."""
    probe = probe_module.StepProbe(blueprint, samples, device, reader)
    probe.open()
    try:
        return search_batch_size(
            probe.measure,
            *search_arguments,
            confirm=lambda batch: probe.measure(
                batch, probe_module.CONFIRM_STEPS, spread=True
            ),
            confirm_budget=confirm_budget,
        )
    finally:
        probe.close()


def _short_device(name: str) -> str:
    spec = tf.DeviceSpec.from_string(name)
    return f"{(spec.device_type or 'CPU').upper()}:{spec.device_index or 0}"


def _probe_device(strategy: Any, device: str | None, reader: Any) -> str:
    """The device to probe: `device`, else the strategy's compute device
    with the least memory (the first one when that is unknown)."""
    logical = [_short_device(d.name) for d in tf.config.list_logical_devices()]
    if device is not None:
        if not isinstance(device, str) or _short_device(device) not in logical:
            raise ValueError(
                f"Argument `device` must be one of this process's logical "
                f"devices {logical}. Received: device={device!r}"
            )
        return _short_device(device)
    try:
        names = list(strategy.extended.worker_devices)
    except (RuntimeError, NotImplementedError, AttributeError):
        names = []  # the default strategy has no device list
    candidates = []
    for name in names:
        short = _short_device(name)
        if short in logical and short not in candidates:
            candidates.append(short)
    if not candidates:
        gpus = [d for d in logical if d.startswith("GPU")]
        return gpus[0] if gpus else "CPU:0"
    capacities = [reader.capacity_mb(d) for d in candidates]
    if len(candidates) > 1 and None not in capacities:
        return candidates[int(np.argmin(capacities))]
    return candidates[0]


def _budget(
    device: str, fraction: float | None, budget_mb: float | None, reader: Any
) -> tuple[float, str]:
    """(budget in MB, where it came from)."""
    if budget_mb is not None:
        return float(budget_mb), "memory_budget_mb"
    fraction = DEFAULT_MEMORY_FRACTION if fraction is None else fraction
    if device.startswith("GPU"):
        capacity = reader.capacity_mb(device)
        if capacity is None:
            raise ValueError(
                f"Cannot tell how much memory {device} has (NVML is not "
                'available: pip install "keras-mgpu[gpu]"), so '
                "`memory_fraction` has nothing to take a fraction of. Pass "
                "`memory_budget_mb` instead."
            )
        where = f"of {device}'s {capacity:,.0f} MB"
    else:
        import psutil

        capacity = psutil.virtual_memory().available / MB
        where = f"of the {capacity:,.0f} MB of host memory available"
    return fraction * capacity, f"memory_fraction={fraction:g} {where}"


def _to_row(
    outcome: SearchOutcome | None,
    budget_mb: float,
    seconds: float,
    margin: float,
) -> np.ndarray:
    """The figures every worker shares (all zero when this one failed)."""
    if outcome is None:
        return np.zeros(12)
    best = outcome.best
    return np.array(
        [
            1.0,
            best.batch_size,
            outcome.fit.fixed_mb,
            outcome.fit.per_sample_mb,
            outcome.predicted_peak_mb,
            best.peak_mb,
            (best.seconds or 0.0) / best.batch_size,
            budget_mb,
            -1 if outcome.upper_bound is None else outcome.upper_bound,
            _LIMITS.index(outcome.limited_by),
            seconds,
            margin,
        ],
        dtype=np.float64,
    )


def _result(rows, outcome, device, source, name) -> BatchSizeResult:
    """The result of the worker with the smallest batch (ties: lowest task),
    identical on every worker."""
    chosen = rows[int(np.argmin(rows[:, 1]))]
    return BatchSizeResult(
        batch_size=int(chosen[1]),
        fixed_mb=float(chosen[2]),
        per_sample_mb=float(chosen[3]),
        peak_mb=float(chosen[4]),
        measured_peak_mb=float(chosen[5]),
        seconds_per_sample=float(chosen[6]),
        budget_mb=float(chosen[7]),
        budget_source=source,
        upper_bound=None if chosen[8] < 0 else int(chosen[8]),
        limited_by=_LIMITS[int(chosen[9])],
        device=device,
        measurements=tuple(
            (m.batch_size, m.peak_mb) for m in outcome.measurements
        ),
        worker_batch_sizes=tuple(int(b) for b in rows[:, 1]),
        search_seconds=float(chosen[10]),
        model_name=name,
        safety_margin=max(float(chosen[11]), 0.0),
    )

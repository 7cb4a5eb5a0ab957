"""`find_batch_size` on Keras's JAX backend: the search over what XLA's
compiled training step needs, instead of allocator peaks of run steps.

`measure(batch)` is the compiled step's need on one device
(`backend.jax.compiled_memory`): deterministic and close to affine in the
batch, so a secant search brackets the answer in a few compilations (each
costs ~1-2 s on a loaded CPU, where TensorFlow's search runs steps): the
smallest batch, one 64 times larger, the line's prediction for the budget,
then the prediction of the line through the bracket until it is one
resolution step (~3%, `search.resolution`) wide. No margin for
step-to-step spread is kept by default (`safety_margin` 0;
`memory_fraction` leaves the headroom); an explicit `safety_margin` lowers
the budget the compiled need must fit. The answer is then run in a short
`fit` of the copy.
"""

from __future__ import annotations

import math
import time
from typing import Any

from keras_mgpu.batch_size import memory_probe as probe_module
from keras_mgpu.batch_size._settings import ProbeSettings
from keras_mgpu.batch_size.samples import SampleBatches
from keras_mgpu.batch_size.search import (
    BudgetTooSmall,
    LinearFit,
    Measurement,
    OutOfMemory,
    SearchOutcome,
    resolution,
)

DEFAULT_MEMORY_FRACTION = 0.9
# Steps down after the confirming `fit` ran out of memory.
CONFIRMATIONS = 3
# The second compilation is at this many times the smallest batch: far
# enough that the line's slope is the batch's, not rounding.
SECOND_PROBE = 64


def search_compiled(
    measure: Any,
    budget_mb: float,
    max_batch_size: int | None,
    multiple_of: int,
    max_trials: int,
) -> SearchOutcome:
    """The largest multiple of `multiple_of` (at most `max_batch_size`)
    whose `measure(batch)` (MB, deterministic) is within `budget_mb`."""
    measurements: list[Measurement] = []
    cap = None
    if max_batch_size is not None:
        cap = max_batch_size // multiple_of * multiple_of

    def run(batch: int, fit: LinearFit | None) -> Measurement:
        predicted = fit.predict(batch) if fit is not None else None
        found = Measurement(batch, measure(batch), None, predicted)
        measurements.append(found)
        return found

    first = run(multiple_of, None)
    if not first.fits(budget_mb):
        raise BudgetTooSmall(
            f"the compiled training step at the smallest batch "
            f"({multiple_of}) needs {first.peak_mb:,.1f} MB, above the "
            f"budget of {budget_mb:,.1f} MB",
            first,
        )
    lo, hi = first, None
    second = multiple_of * SECOND_PROBE
    if cap is not None:
        second = min(second, cap)
    fit: LinearFit | None = None
    candidate = second if second > lo.batch_size else None
    limited_by = "max_batch_size"
    while candidate is not None:
        if len(measurements) >= max_trials:
            limited_by = "trials"
            break
        found = run(candidate, fit)
        if found.fits(budget_mb):
            lo = found
        else:
            hi = found
        candidate, limited_by, fit = _next_compiled(
            measurements, lo, hi, budget_mb, cap, multiple_of
        )
    return SearchOutcome(
        best=lo,
        upper_bound=None if hi is None else hi.batch_size,
        fit=_reported_line(measurements, lo),
        limited_by=limited_by,
        measurements=tuple(measurements),
    )


def _next_compiled(measurements, lo, hi, budget_mb, cap, multiple_of):
    """(next batch or None, why the search stops, the line used)."""
    if cap is not None and lo.batch_size >= cap:
        return None, "max_batch_size", None
    step = resolution(lo.batch_size, multiple_of)
    if hi is not None and hi.batch_size - lo.batch_size <= step:
        return None, "memory", None
    other = hi
    if other is None:
        below = [m for m in measurements if m.batch_size < lo.batch_size]
        other = max(below, key=lambda m: m.batch_size)
    fit = LinearFit.through(other, lo)
    target = fit.largest_batch(budget_mb)
    upper = hi.batch_size - multiple_of if hi is not None else math.inf
    if cap is not None:
        upper = min(upper, cap)
    target = min(target, upper)
    # Past the line's answer by a step: the bracket closes there.
    if target < lo.batch_size + step:
        target = lo.batch_size + step
        if hi is not None:
            target = min(target, hi.batch_size - multiple_of)
        if cap is not None:
            target = min(target, cap)
    candidate = int(target) // multiple_of * multiple_of
    measured = {m.batch_size for m in measurements}
    if candidate <= lo.batch_size or candidate in measured:
        return None, "memory", fit
    return candidate, "", fit


def _reported_line(measurements: list, best: Measurement) -> LinearFit:
    """The least-squares line through the compilations at batches from
    1/8 of the answer up (all of them when fewer sizes are there)."""
    near = [m for m in measurements if m.batch_size * 8 >= best.batch_size]
    if len({m.batch_size for m in near}) < 2:
        near = measurements
    return LinearFit.least_squares(near)


def check_distribution(strategy: Any) -> Any:
    """`strategy` (a `keras.distribution.Distribution`) or the one in
    force; a TypeError for anything else (a `tf.distribute` strategy)."""
    from keras_mgpu.backend.jax import distribution as jax_distribution

    # Keras 3.15 exports DataParallel and ModelParallel, not their base
    # class: recognise a distribution by what the probe uses.
    if strategy is not None and not all(
        hasattr(strategy, name)
        for name in ("device_mesh", "scope", "get_data_layout")
    ):
        raise TypeError(
            "Argument `strategy` must be a keras.distribution.Distribution "
            "(DataParallel, ModelParallel) or None on the JAX backend. "
            f"Received: strategy={strategy!r}"
        )
    return jax_distribution.current_distribution(strategy)


def budget_on_jax(
    distribution: Any,
    device: str | None,
    fraction: float | None,
    budget_mb: float | None,
) -> tuple[float, str, str]:
    """(budget in MB, where it came from, the device named in the result).

    The device's limit is XLA's (`memory_stats()["bytes_limit"]`), the
    smallest over the distribution's devices; a CPU reports none, so
    `memory_budget_mb` is required there.
    """
    from keras_mgpu.backend.jax import devices as jax_devices

    if device is not None:
        devices = [jax_devices.named_device(device)]
    else:
        devices = jax_devices.distribution_devices(distribution)
    limits = [jax_devices.limit_mb(d) for d in devices]
    named = jax_devices.device_name(devices[0])
    if budget_mb is not None:
        return float(budget_mb), "memory_budget_mb", named
    if None in limits:
        raise ValueError(
            f"{named} reports no memory limit to JAX (CPU devices have "
            "none), so `memory_fraction` has nothing to take a fraction "
            "of: pass `memory_budget_mb` (the memory one device may use "
            "for training, in MB) on the JAX backend's CPU."
        )
    index = min(range(len(limits)), key=lambda i: limits[i])
    named = jax_devices.device_name(devices[index])
    fraction = DEFAULT_MEMORY_FRACTION if fraction is None else fraction
    return (
        fraction * limits[index],
        f"memory_fraction={fraction:g} of {named}'s {limits[index]:,.0f} MB "
        "(XLA's bytes_limit)",
        named,
    )


def probe_compiled(model: Any, data: Any, settings: ProbeSettings) -> Any:
    """`finder.probe_batch_size` on the JAX backend (`settings` checked).
    `settings.safety_margin` None keeps none: the compiled need does not
    vary from step to step."""
    from keras_mgpu.backend.jax import compiled_memory
    from keras_mgpu.backend.jax.distribution import data_parallel_size
    from keras_mgpu.batch_size.result import MB, BatchSizeResult, _explained

    distribution = check_distribution(settings.strategy)
    replicas = data_parallel_size(distribution)
    blueprint = probe_module.ModelBlueprint(
        model, accumulate=settings.accumulate
    )
    samples = SampleBatches(data)
    budget_mb, source, named = budget_on_jax(
        distribution,
        settings.device,
        settings.memory_fraction,
        settings.memory_budget_mb,
    )
    margin = settings.safety_margin or 0.0
    search_budget = budget_mb * (1 - margin)
    start = time.perf_counter()
    memory = compiled_memory.StepMemory(
        blueprint, samples, distribution, replicas
    )
    memory.open(settings.multiple_of)
    try:

        def measure(batch: int) -> float:
            return memory.need_bytes(batch) / MB

        try:
            outcome = search_compiled(
                measure,
                search_budget,
                settings.max_batch_size,
                settings.multiple_of,
                settings.max_trials,
            )
        except BudgetTooSmall as exc:
            raise _explained(
                exc,
                settings.memory_fraction,
                settings.memory_budget_mb,
                source,
                margin=margin,
            ) from None
        best, upper, limited_by, seconds = _confirmed(
            memory, outcome, settings.multiple_of, search_budget
        )
    finally:
        memory.close()
    result = BatchSizeResult(
        batch_size=best.batch_size,
        fixed_mb=outcome.fit.fixed_mb,
        per_sample_mb=outcome.fit.per_sample_mb,
        peak_mb=outcome.fit.predict(best.batch_size),
        measured_peak_mb=best.peak_mb,
        seconds_per_sample=seconds / best.batch_size,
        budget_mb=budget_mb,
        budget_source=source,
        upper_bound=upper,
        limited_by=limited_by,
        device=named,
        measurements=tuple(
            (m.batch_size, m.peak_mb) for m in outcome.measurements
        )
        + tuple((b, p) for b, p in _extra(best, outcome)),
        worker_batch_sizes=(best.batch_size,),
        search_seconds=time.perf_counter() - start,
        model_name=blueprint.name,
        safety_margin=margin,
        measured_by="compiled",
    )
    if settings.verbose:
        print(result.explain())
    return result


def _extra(best: Measurement, outcome: Any) -> list:
    # A batch the confirmation stepped down to, measured after the search.
    if any(m.batch_size == best.batch_size for m in outcome.measurements):
        return []
    return [(best.batch_size, best.peak_mb)]


def _confirmed(memory, outcome, multiple_of: int, budget_mb: float) -> tuple:
    """(answer, upper bound, limited_by, seconds of a step): the search's
    answer once a short `fit` ran it, stepped down by a tenth after an
    out-of-memory error (at most `CONFIRMATIONS` times)."""
    best = outcome.best
    upper, limited_by = outcome.upper_bound, outcome.limited_by
    for _ in range(CONFIRMATIONS):
        try:
            return best, upper, limited_by, memory.confirm(best.batch_size)
        except OutOfMemory:
            upper, limited_by = best.batch_size, "memory"
            smaller = int(0.9 * best.batch_size) // multiple_of * multiple_of
            if smaller < multiple_of:
                break
            best = Measurement(smaller, memory.need_bytes(smaller) / 2**20)
    raise ValueError(
        f"find_batch_size: the training step ran out of device memory in "
        f"`fit` at batch {best.batch_size} although XLA's compiled need "
        f"({best.peak_mb:,.1f} MB) is within the budget of "
        f"{budget_mb:,.1f} MB: lower `memory_fraction` or "
        "`memory_budget_mb`."
    )

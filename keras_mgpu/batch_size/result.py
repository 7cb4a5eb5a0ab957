"""What `find_batch_size` returns (`BatchSizeResult`) and how its refusal
reads (`_explained`): shared by the TensorFlow search (`finder`) and the
compiled one on JAX (`compiled_search`), which the finder calls."""

from __future__ import annotations

import dataclasses

from keras_mgpu.batch_size.search import BudgetTooSmall

MB = 1024.0 * 1024.0
# The least safety margin, a fraction of the budget (the margin and how the
# default one is derived: the comment above `finder.MAX_SAFETY_MARGIN`).
MIN_SAFETY_MARGIN = 0.03


@dataclasses.dataclass(frozen=True)
class BatchSizeResult:
    """What `find_batch_size` found.

    Memory figures are TensorFlow allocator peaks of one training step on
    the probe device, in MB (2**20 bytes), above what the device held
    before the probe: the model's weights, optimizer state, the batch and
    the step's activations, gradients and workspace. On JAX
    (`measured_by == "compiled"`) they are what XLA's compiled step needs
    on one device (arguments + outputs - donated + temporaries), read
    without running it.

    Attributes:
        batch_size: the largest per-replica batch that fits (a multiple of
            `multiple_of`, at most `max_batch_size`).
        fixed_mb, per_sample_mb: the fitted memory model `peak = fixed_mb +
            per_sample_mb * batch`, the least-squares line through the
            peaks of the probes at batches from 1/8 of `batch_size` up
            (where it is used; tiny batches are mostly rounding); where
            that line is above the budget at the answer, the line with its
            slope through the answer's measured peak.
        peak_mb: that line's peak at `batch_size`; `measured_peak_mb`: the
            highest step peak measured there, over the 12 steps that
            confirmed the answer (`memory_probe.CONFIRM_STEPS`).
        seconds_per_sample: duration of one step at `batch_size`, per sample.
        budget_mb, budget_source: the budget and where it came from.
        upper_bound: the smallest batch measured not to fit (its peak over
            the budget, or out of memory; in the search or in a
            confirmation); None if none was tried.
        limited_by: "memory", "max_batch_size" or "trials".
        device: the probe device of this process.
        measurements: `(batch_size, peak_mb)` of every probe this process
            ran (3 steps, the highest peak; the confirmations 12), in
            order; `peak_mb` is None for an out-of-memory error.
        worker_batch_sizes: each worker's own answer (one entry without a
            cluster); `batch_size` is their minimum.
        search_seconds: wall time of this process's search.
        safety_margin: the fraction of the budget kept free: every probe
            counted as fitting (and `peak_mb`) stays within
            `budget_mb * (1 - safety_margin)`, for how much higher a
            training run's step peaks go: the `safety_margin` argument, or
            by default the margin the confirmation called for (see
            `find_batch_size`); by default 0 on JAX, where the compiled
            need does not vary from step to step.
        measured_by: "allocator" (TensorFlow's allocator peaks of run
            steps) or "compiled" (XLA's compiled memory analysis, JAX).
    """

    batch_size: int
    fixed_mb: float
    per_sample_mb: float
    peak_mb: float
    measured_peak_mb: float
    seconds_per_sample: float
    budget_mb: float
    budget_source: str
    upper_bound: int | None
    limited_by: str
    device: str
    measurements: tuple[tuple[int, float | None], ...]
    worker_batch_sizes: tuple[int, ...]
    search_seconds: float
    model_name: str = ""
    safety_margin: float = MIN_SAFETY_MARGIN
    measured_by: str = "allocator"

    @property
    def search_budget_mb(self) -> float:
        """The budget less the safety margin: what the steps had to fit."""
        return self.budget_mb * (1 - self.safety_margin)

    def _explain_compiled(self) -> str:
        text = (
            f"One training step of {self.model_name!r} (forward, backward "
            "and optimizer update, compiled by XLA for each candidate "
            f"batch and not run) needs {self.fixed_mb:,.1f} MB + "
            f"{self.per_sample_mb:,.4g} MB per sample on one device "
            f"({self.device}; XLA's memory analysis of "
            f"{len(self.measurements)} compilations). Within the budget of "
            f"{self.budget_mb:,.1f} MB ({self.budget_source})"
            + (
                f", less a {self.safety_margin:.0%} safety margin "
                f"({self.search_budget_mb:,.1f} MB),"
                if self.safety_margin
                else ""
            )
            + " the largest "
            f"batch per replica is {self.batch_size:,}: it needs "
            f"{self.measured_peak_mb:,.1f} MB"
        )
        text += self._what_limits()
        return text + (
            f". The search and a short `fit` at the answer took "
            f"{self.search_seconds:.1f} s; one step takes "
            f"{1e3 * self.seconds_per_sample:.3g} ms per sample."
        )

    def _what_limits(self) -> str:
        """Why the answer is not larger, for `explain`."""
        text = ""
        if self.limited_by == "max_batch_size":
            text += ", and it is the cap (max_batch_size)"
        elif self.upper_bound is not None:
            text += f"; {self.upper_bound:,} did not fit"
        if self.limited_by == "trials":
            text += " (the search stopped at max_trials)"
        return text

    def predict_peak_mb(self, batch_size: int) -> float:
        """The fitted line's peak for `batch_size` (MB)."""
        return self.fixed_mb + self.per_sample_mb * batch_size

    def explain(self) -> str:
        """What was measured and why this batch, in one paragraph."""
        if self.measured_by == "compiled":
            return self._explain_compiled()
        text = (
            f"One training step of {self.model_name!r} (forward, backward "
            f"and optimizer update, run on a copy on {self.device}) needs "
            f"{self.fixed_mb:,.1f} MB + {self.per_sample_mb:,.4g} MB per "
            f"sample (TensorFlow allocator peaks of "
            f"{len(self.measurements)} probes of a few steps each, line "
            f"fitted near the answer). Within the budget of "
            f"{self.budget_mb:,.1f} MB ({self.budget_source}), less a "
            f"{self.safety_margin:.0%} margin for the spread of a training "
            f"run's step peaks "
            f"({self.search_budget_mb:,.1f} MB), the largest batch is "
            f"{self.batch_size:,}: predicted peak {self.peak_mb:,.1f} MB, "
            f"measured {self.measured_peak_mb:,.1f} MB"
        )
        text += self._what_limits()
        if len(self.worker_batch_sizes) > 1:
            text += (
                "; the smallest of the workers' answers "
                f"{list(self.worker_batch_sizes)}"
            )
        return text + (
            f". {len(self.measurements)} probes took "
            f"{self.search_seconds:.1f} s; one step takes "
            f"{1e3 * self.seconds_per_sample:.3g} ms per sample."
        )


def _explained(
    error: Exception,
    fraction: float | None,
    budget: float | None,
    source,
    margin: float = MIN_SAFETY_MARGIN,
) -> Exception:
    """`BudgetTooSmall` as a ValueError naming the budget argument; other
    errors unchanged."""
    if not isinstance(error, BudgetTooSmall):
        return error
    if budget is not None:
        argument = f"Argument `memory_budget_mb`={budget:g} is too small"
    else:
        argument = (
            f"Argument `memory_fraction` gives a budget too small ({source})"
        )
    first = error.measurement
    figure = (
        "it ran out of device memory"
        if first.out_of_memory
        else f"its measured peak is {first.peak_mb:,.1f} MB"
    )
    less = (
        f" (the budget less the {margin:.0%} safety margin)" if margin else ""
    )
    message = (
        f"{argument}: {error}{less}. That is the fixed cost of training this "
        f"model (weights, optimizer state, one step at batch "
        f"{first.batch_size}): {figure}."
    )
    exc = ValueError(message)
    exc.__cause__ = error
    return exc

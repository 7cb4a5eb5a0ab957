"""The search for the largest batch whose training step fits a memory budget.

A pure function of a `measure(batch_size)` callable, so the same search runs
on TensorFlow's allocator (`memory_probe.StepProbe`) and on the fakes of the
unit tests (out-of-memory errors included). No TensorFlow here.

The memory of one training step is close to linear in the batch size,
`peak = fixed + per_sample * batch`, but not exactly: kernels change
algorithm with the batch, so a line fitted at small batches can be 20-30%
off at large ones (measured on CPU with oneDNN). The search therefore fits
the line, jumps to its prediction, and keeps a bracket: the largest batch
measured to fit (`lo`) and the smallest measured not to (`hi`). Once both
exist, each new candidate is interpolated between them (kept off the
bracket's outer quarters), or is their midpoint when the last two steps
fell on the same side: the allocator's peaks rise in steps and plateaus,
where interpolation alone creeps towards the answer. It stops when the
bracket is one resolution step wide (~3%).

A step's peak is not one figure: with parallel ops the order in which
buffers are freed, and so how the allocator's chunks are split, varies
from step to step, and the peaks of one batch size spread over ~15%. The
search keeps the largest batch whose few steps happened to peak low, so
its answer is re-measured over a longer run (`confirm`), and stepped down
where that run peaks above the budget.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator

# Raised by each backend's memory probe; defined in the backend layer, which
# imports nothing above it.
from keras_mgpu.backend.errors import OutOfMemory  # noqa: F401

# The search stops when the bracket is at most this fraction of the batch
# wide (and at least `multiple_of`): ~3%, one "probe step".
RELATIVE_RESOLUTION = 1 / 32
# Before a batch that does not fit is known, a candidate is at most this
# many times the largest batch that fits: an extrapolation from small
# batches is not trusted further than that.
MAX_GROWTH = 8
DEFAULT_MAX_TRIALS = 16
# The reported line is fitted to the steps at batches >= answer / FIT_RANGE.
FIT_RANGE = 8
# At most this many confirmation runs (each failure steps down once).
CONFIRMATIONS = 3


@dataclasses.dataclass(frozen=True)
class LinearFit:
    """`peak_mb = fixed_mb + per_sample_mb * batch_size`, through the
    measurements at `batch_sizes`."""

    fixed_mb: float
    per_sample_mb: float
    batch_sizes: tuple[int, ...]

    @classmethod
    def through(cls, first: Measurement, second: Measurement) -> LinearFit:
        """The line through two measurements with peaks (a flat line
        through one, when both have the same batch size)."""
        if first.batch_size == second.batch_size:
            peak = max(first.peak_mb, second.peak_mb)
            return cls(peak, 0.0, (first.batch_size,))
        low, high = sorted((first, second), key=lambda m: m.batch_size)
        slope = (high.peak_mb - low.peak_mb) / (
            high.batch_size - low.batch_size
        )
        return cls(
            low.peak_mb - slope * low.batch_size,
            slope,
            (low.batch_size, high.batch_size),
        )

    @classmethod
    def least_squares(cls, measurements: list[Measurement]) -> LinearFit:
        """The least-squares line through the measurements with peaks (a
        flat line when they have a single batch size), with `fixed_mb >=
        0`: a line that would cross zero above batch 0 (allocator steps
        near the answer can tilt it so) goes through the origin instead."""
        points = [(m.batch_size, m.peak_mb) for m in measurements]
        points = [(b, p) for b, p in points if p is not None]
        sizes = tuple(sorted({b for b, _ in points}))
        if len(sizes) < 2:
            return cls(max(p for _, p in points), 0.0, sizes)
        mean_b = sum(b for b, _ in points) / len(points)
        mean_p = sum(p for _, p in points) / len(points)
        slope = sum((b - mean_b) * (p - mean_p) for b, p in points) / sum(
            (b - mean_b) ** 2 for b, _ in points
        )
        if mean_p - slope * mean_b < 0:
            through_origin = sum(b * p for b, p in points) / sum(
                b * b for b, _ in points
            )
            return cls(0.0, through_origin, sizes)
        return cls(mean_p - slope * mean_b, slope, sizes)

    def predict(self, batch_size: int) -> float:
        return self.fixed_mb + self.per_sample_mb * batch_size

    def largest_batch(self, budget_mb: float) -> float:
        """The (fractional) batch at which the line reaches `budget_mb`;
        infinite when it never does (a flat or falling line)."""
        if self.per_sample_mb <= 0:
            return math.inf
        return (budget_mb - self.fixed_mb) / self.per_sample_mb


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One measured training step.

    `peak_mb` is None when the step ran out of memory. `predicted_mb` is
    what the search's line predicted for this batch before it was measured
    (None for the first two probes). `confirmation`: measured over the
    longer run that confirms an answer. `spread`: how far the run's
    highest step peak stands above its median step, in MB (None where the
    measure did not report it).
    """

    batch_size: int
    peak_mb: float | None
    seconds: float | None = None
    predicted_mb: float | None = None
    confirmation: bool = False
    spread: float | None = None

    @property
    def out_of_memory(self) -> bool:
        return self.peak_mb is None

    def fits(self, budget_mb: float) -> bool:
        return self.peak_mb is not None and self.peak_mb <= budget_mb


class BudgetTooSmall(ValueError):
    """Even the smallest batch's training step exceeds the budget."""

    def __init__(self, message: str, measurement: Measurement) -> None:
        super().__init__(message)
        self.measurement = measurement


@dataclasses.dataclass(frozen=True)
class SearchOutcome:
    """What the search found.

    `best`: the largest measurement that fits. `upper_bound`: the smallest
    batch measured not to fit (None if none was measured). `fit`: the
    memory model to report, the least-squares line through the peaks
    measured at batches from 1/`FIT_RANGE` of the answer up (all of them
    when fewer than two sizes are there): at tiny batches the peak is
    mostly allocator rounding, and the line should be right where it is
    used, near the answer.
    `budget_mb`: the budget the answer was held to (the search's, or the
    lower one a confirmation's spread called for).
    `limited_by`: "memory" (bracket one step wide),
    "max_batch_size" (the cap fits) or "trials" (the trial budget ran out
    first). `measurements`: every step, in order.
    """

    best: Measurement
    upper_bound: int | None
    fit: LinearFit
    limited_by: str
    measurements: tuple[Measurement, ...]
    budget_mb: float | None = None

    @property
    def predicted_peak_mb(self) -> float:
        """The fitted line's peak at the answer."""
        return self.fit.predict(self.best.batch_size)


def resolution(batch_size: int, multiple_of: int) -> int:
    """The search's step near `batch_size`: ~3% of it, a multiple of
    `multiple_of`."""
    step = math.ceil(batch_size * RELATIVE_RESOLUTION)
    return max(multiple_of, multiple_of * math.ceil(step / multiple_of))


def search_batch_size(
    measure: Callable[[int], tuple[float, float]],
    budget_mb: float,
    max_batch_size: int | None = None,
    multiple_of: int = 1,
    max_trials: int = DEFAULT_MAX_TRIALS,
    confirm: Callable[[int], tuple] | None = None,
    confirm_budget: Callable[[Measurement, float], float] | None = None,
) -> SearchOutcome:
    """The largest multiple of `multiple_of` (up to `max_batch_size`) whose
    measured step peak is at most `budget_mb`.

    `measure(batch)` runs a few training steps and returns `(peak_mb,
    seconds)`, their highest peak, or raises `OutOfMemory`. The first two
    probes are `multiple_of` and twice that; each later one is chosen as
    described in the module docstring. Raises `BudgetTooSmall` when the
    first probe does not fit. `confirm(batch)`, where given, measures a
    longer run, `(peak_mb, seconds)` or `(peak_mb, seconds, spread)`: the
    answer must fit over it too (see `_Search.confirm`); `max_trials`
    counts the search's probes, not these. `confirm_budget(measurement,
    fixed_mb)`, where given, is the budget a confirmation's run must fit,
    derived from what it measured (its peak and `spread`) and the fixed
    part of the reported line there; from then on the whole search is held
    to it where it is lower than `budget_mb` (`SearchOutcome.budget_mb`).
    """
    search = _Search(measure, budget_mb, max_batch_size, multiple_of)
    first = search.run(multiple_of)
    if not first.fits(budget_mb):
        what = (
            "ran out of device memory"
            if first.out_of_memory
            else f"peaks at {first.peak_mb:,.1f} MB"
        )
        raise BudgetTooSmall(
            f"one training step at the smallest batch ({multiple_of}) "
            f"{what}, above the budget of {budget_mb:,.1f} MB",
            first,
        )
    # A second small probe gives the first line, even when the cap allows
    # only the first batch.
    search.run(2 * multiple_of)
    limited_by = "trials"
    while len(search.measurements) < max_trials:
        candidate, limited_by = search.next_candidate()
        if candidate is None:
            break
        search.run(candidate)
    else:
        _, stop = search.next_candidate()
        limited_by = stop or "trials"
    search.settle()
    if confirm is not None:
        search.confirm(confirm, budget_for=confirm_budget)
    outcome = search.outcome(limited_by)
    if (
        limited_by == "max_batch_size"
        and outcome.best.batch_size < search._cap()
    ):
        # The cap did not fit over the confirmation's longer run.
        outcome = dataclasses.replace(outcome, limited_by="memory")
    return outcome


class _Search:
    """The measurements so far and the bracket they give."""

    def __init__(self, measure, budget_mb, max_batch_size, multiple_of):
        self._measure = measure
        self.budget_mb = budget_mb
        self.max_batch_size = max_batch_size
        self.multiple_of = multiple_of
        self.measurements: list[Measurement] = []
        self._fit: LinearFit | None = None
        self._confirmed: Measurement | None = None

    def run(self, batch_size: int, measure=None) -> Measurement:
        """Measure `batch_size` with the search's `measure`, or with the
        given one (a confirmation)."""
        predicted = self._fit.predict(batch_size) if self._fit else None
        spread = None
        try:
            figures = (measure or self._measure)(batch_size)
            peak, seconds = figures[:2]
            if len(figures) > 2:
                spread = figures[2]
        except OutOfMemory:
            peak, seconds = None, None
        measurement = Measurement(
            batch_size, peak, seconds, predicted, measure is not None, spread
        )
        self.measurements.append(measurement)
        return measurement

    def _fitting(self) -> list[Measurement]:
        """Measurements that fit, below the cap and below the smallest
        batch that did not fit (memory is not always monotone in the
        batch: the conservative answer lies below every failure)."""
        limit = self.max_batch_size or math.inf
        failure = self._lowest_failure()
        if failure is not None:
            limit = min(limit, failure.batch_size - 1)
        fitting = [
            m
            for m in self.measurements
            if m.fits(self.budget_mb) and m.batch_size <= limit
        ]
        return sorted(fitting, key=lambda m: m.batch_size)

    def _lowest_failure(self) -> Measurement | None:
        failing = [m for m in self.measurements if not m.fits(self.budget_mb)]
        return min(failing, key=lambda m: m.batch_size, default=None)

    def _round_down(self, batch: float) -> int:
        return int(batch // self.multiple_of) * self.multiple_of

    def _cap(self) -> int | None:
        if self.max_batch_size is None:
            return None
        return self._round_down(self.max_batch_size)

    def next_candidate(self) -> tuple[int | None, str]:
        """(next batch to measure, or None) and why the search would stop
        here."""
        fitting = self._fitting()
        lo = fitting[-1]
        hi = self._lowest_failure()
        cap = self._cap()
        if cap is not None and lo.batch_size >= cap:
            return None, "max_batch_size"
        step = resolution(lo.batch_size, self.multiple_of)
        if hi is not None and hi.batch_size - lo.batch_size <= step:
            return None, "memory"
        self._fit = self._line(fitting, hi)
        upper = hi.batch_size - 1 if hi else lo.batch_size * MAX_GROWTH
        if cap is not None:
            upper = min(upper, cap)
        target = self._fit.largest_batch(self.budget_mb)
        if hi is not None:
            target = self._in_bracket(lo.batch_size, hi.batch_size, target)
        candidate = self._round_down(min(target, upper))
        if candidate <= lo.batch_size:
            # The line says lo is the answer: test one step above it, so
            # the bracket closes (unless the cap is already there).
            candidate = lo.batch_size + step
            if cap is not None:
                candidate = min(candidate, cap)
        if hi is not None and candidate >= hi.batch_size:
            candidate = self._round_down((lo.batch_size + hi.batch_size) / 2)
        measured = {m.batch_size for m in self.measurements}
        if candidate <= lo.batch_size or candidate in measured:
            return None, "memory"
        return candidate, ""

    def _in_bracket(self, lo: int, hi: int, target: float) -> float:
        """The interpolated `target`, kept off the bracket's outer
        quarters (so the bracket shrinks by a quarter at least), or the
        midpoint after two steps on the same side: the allocator's peaks
        rise in steps and plateaus, where interpolation alone creeps."""
        if self._same_side_twice():
            return (lo + hi) / 2
        width = hi - lo
        return min(max(target, lo + width / 4), hi - width / 4)

    def _same_side_twice(self) -> bool:
        """Whether the last two steps both fit, or both did not."""
        if len(self.measurements) < 4:  # the two first probes do not count
            return False
        last, before = self.measurements[-1], self.measurements[-2]
        return last.fits(self.budget_mb) == before.fits(self.budget_mb)

    def _line(self, fitting: list, hi: Measurement | None) -> LinearFit:
        """Interpolate between the bracket's ends when the upper one has a
        peak; else extrapolate from the largest batch that fits and one at
        most half as large: over a long base the allocator's plateaus
        average out (two neighbours on one plateau give a flat line)."""
        lo = fitting[-1]
        if hi is not None and not hi.out_of_memory:
            return LinearFit.through(lo, hi)
        far = [m for m in fitting if 2 * m.batch_size <= lo.batch_size]
        below = far[-1] if far else fitting[max(len(fitting) - 2, 0)]
        return LinearFit.through(below, lo)

    def _reported_fit(self, answer: int, below: bool = False) -> LinearFit:
        """The least-squares line near `answer` (`FIT_RANGE`), through the
        peaks on both sides of it, or (`below`) only through those at or
        below it."""
        with_peaks = [m for m in self.measurements if m.peak_mb is not None]
        if below:
            with_peaks = [m for m in with_peaks if m.batch_size <= answer]
        near = [m for m in with_peaks if m.batch_size * FIT_RANGE >= answer]
        if len({m.batch_size for m in near}) >= 2:
            return LinearFit.least_squares(near)
        return LinearFit.least_squares(with_peaks)

    def _within_budget(self, fit: LinearFit, best: Measurement) -> bool:
        # Float rounding of an exact line may land a hair above the budget.
        return fit.predict(best.batch_size) <= self.budget_mb * (1 + 1e-9)

    def _answer(self) -> tuple[Measurement, LinearFit]:
        """The largest batch that fits whose reported line also stays
        within the budget there, and that line.

        A measured peak within the budget is not enough: where the line
        (what the user reads as the answer's peak) says more, the next
        step at that batch may too. When no measured batch qualifies, the
        smallest one is reported with a flat line through its peak.
        """
        fitting = self._fitting()
        for best in reversed(fitting):
            for fit in self._reported_fits(best):
                if self._within_budget(fit, best):
                    return best, fit
        return fitting[0], LinearFit.through(fitting[0], fitting[0])

    def _reported_fits(self, best: Measurement) -> Iterator[LinearFit]:
        """The line to report at `best`, then the one through the peaks
        at or below it only: a line through points on both sides of the
        answer lies above a convex memory curve there (and so may put a
        batch measured within the budget above it), one through the
        points below it does not."""
        yield self._reported_fit(best.batch_size)
        if len({m.batch_size for m in self._fitting()}) >= 2:
            yield self._reported_fit(best.batch_size, below=True)

    def settle(self, extra_steps: int = 2) -> None:
        """Where the reported line puts the largest fitting batch above
        the budget, measure the batch at which it reaches the budget (at
        most `extra_steps` more steps), so that `_answer` need not fall
        back to a much smaller measured batch."""
        for _ in range(extra_steps):
            best = self._fitting()[-1]
            if any(
                self._within_budget(fit, best)
                for fit in self._reported_fits(best)
            ):
                return
            fit = self._reported_fit(best.batch_size)
            candidate = self._round_down(fit.largest_batch(self.budget_mb))
            measured = {m.batch_size for m in self.measurements}
            if (
                candidate < self.multiple_of
                or candidate >= best.batch_size
                or candidate in measured
            ):
                return
            self.run(candidate)

    def confirm(
        self, measure, attempts: int = CONFIRMATIONS, budget_for=None
    ) -> None:
        """Re-measure the answer with `measure` (a longer run); where it
        peaks above the budget, step down and measure again, at most
        `attempts` times in all.

        `budget_for(measurement, fixed_mb)`, where given, is the budget a
        run with the peak and spread it measured must fit (`fixed_mb`: the
        reported line's fixed part there): where lower than the search's,
        it becomes the search's budget (every earlier probe is judged
        against it too, so the answer stays below each failure).

        The search's answer is the largest batch whose few steps peaked
        within the budget: among batches near the budget, the one whose
        steps happened to peak low. Each step down is sized by the excess
        (see `_below_failure`), never to an older, far smaller
        measurement. When every attempt peaks above the budget, the
        answer is the search's largest fitting batch below them all.
        """
        batch = self._answer()[0].batch_size
        # A run that lowers the budget does not use up an attempt (at most
        # `attempts` such runs): the answer is always one a longer run
        # confirmed against the budget in force at the end.
        remaining, lowerings = attempts, attempts
        while remaining > 0:
            remaining -= 1
            checked = self.run(batch, measure)
            if budget_for is not None and not checked.out_of_memory:
                fixed = self._reported_fit(batch).fixed_mb
                fixed = min(max(fixed, 0.0), checked.peak_mb)
                wanted = budget_for(checked, fixed)
                if wanted < self.budget_mb and lowerings > 0:
                    lowerings -= 1
                    remaining += 1
                self.budget_mb = min(self.budget_mb, wanted)
            if checked.fits(self.budget_mb):
                self._confirmed = checked
                return
            if not self._fitting():
                what = (
                    "ran out of device memory"
                    if checked.out_of_memory
                    else f"peaks at {checked.peak_mb:,.1f} MB"
                )
                raise BudgetTooSmall(
                    "one training step at the smallest batch "
                    f"({checked.batch_size}) {what} over a longer run, "
                    f"above the budget of {self.budget_mb:,.1f} MB",
                    checked,
                )
            batch = self._below_failure(checked)
            if batch is None:
                return

    def _below_failure(self, failed: Measurement) -> int | None:
        """The batch to confirm next after `failed` (a longer run) peaked
        above the budget: lower by the share of its batch-dependent memory
        the excess is, taking the fixed part from the reported line but at
        most half the peak (a line tilted by the allocator's steps must
        not send the answer far down), and one resolution step more.
        An out-of-memory run steps down by a quarter. Never below
        `multiple_of` (None once that failed)."""
        batch = failed.batch_size
        step = resolution(batch, self.multiple_of)
        if failed.peak_mb is None:
            drop = batch / 4
        else:
            peak = failed.peak_mb
            fixed = self._reported_fit(batch).fixed_mb
            fixed = min(max(fixed, 0.0), peak / 2)
            drop = batch * (peak - self.budget_mb) / (peak - fixed)
        candidate = self._round_down(batch - drop - step)
        if candidate < self.multiple_of < batch:
            return self.multiple_of  # the smallest batch, last
        return candidate if candidate >= self.multiple_of else None

    def _confirmed_answer(self) -> tuple[Measurement, LinearFit]:
        """The confirmed measurement and the reported line there; where
        neither reported line stays within the budget at it, the line
        with the reported slope through its measured peak."""
        best = self._confirmed
        fits = list(self._reported_fits(best))
        for fit in fits:
            if self._within_budget(fit, best):
                return best, fit
        slope = max(fits[0].per_sample_mb, 0.0)
        fixed = max(best.peak_mb - slope * best.batch_size, 0.0)
        return best, LinearFit(fixed, slope, fits[0].batch_sizes)

    def outcome(self, limited_by: str) -> SearchOutcome:
        if self._confirmed is not None:
            best, fit = self._confirmed_answer()
        else:
            best, fit = self._answer()
        hi = self._lowest_failure()
        return SearchOutcome(
            best=best,
            upper_bound=None if hi is None else hi.batch_size,
            fit=fit,
            limited_by=limited_by,
            measurements=tuple(self.measurements),
            budget_mb=self.budget_mb,
        )

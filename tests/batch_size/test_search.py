"""The batch-size search on synthetic memory curves (no TensorFlow steps):
linear, staircase (as TensorFlow's CPU allocator gives), quadratic,
out-of-memory errors, caps, noise."""

from __future__ import annotations

import math

import pytest

from keras_mgpu.batch_size.search import (
    BudgetTooSmall,
    LinearFit,
    Measurement,
    OutOfMemory,
    _Search,
    resolution,
    search_batch_size,
)


def linear(batch):
    return 20.0 + 0.05 * batch


def staircase(batch):
    # Peaks that rise by whole buffers: flat runs, then jumps of ~6%.
    return math.floor(0.12 * batch / 6.5) * 6.5


def jump(batch):
    # One extra activation-sized buffer lives on above a threshold.
    return 23.0 + 0.0125 * batch + (5.0 if batch >= 2400 else 0.0)


def quadratic(batch):
    return 10.0 + 0.01 * batch + 2e-6 * batch**2


def _true_largest(curve, budget, multiple_of=1, start=1):
    batch = start
    while curve(batch + multiple_of) <= budget:
        batch += multiple_of
    return batch


def _measure(curve, log=None, oom_above=None):
    def measure(batch):
        if log is not None:
            log.append(batch)
        if oom_above is not None and batch > oom_above:
            raise OutOfMemory("fake")
        return curve(batch), 1e-3 * batch

    return measure


@pytest.mark.parametrize("curve", [linear, staircase, jump, quadratic])
def test_finds_the_largest_batch_within_one_step(curve):
    # One test per curve, the budgets in a loop: the session fixture's
    # per-test Keras reset costs more than these searches.
    for budget in (60.0, 100.0, 300.0, 1000.0):
        outcome = search_batch_size(_measure(curve), budget)
        best = outcome.best.batch_size
        true = _true_largest(curve, budget)
        assert curve(best) <= budget
        assert outcome.best.peak_mb == curve(best)
        assert outcome.limited_by == "memory"
        # The bracket is one resolution step (~3%) wide, and its upper end
        # really fails; where the fitted line put that lower end above the
        # budget, the answer steps down to where the line meets it (see
        # test_the_reported_peak_never_exceeds_the_budget).
        steps = 2
        assert curve(outcome.upper_bound) > budget
        assert outcome.upper_bound - best <= steps * resolution(best, 1)
        assert true - best <= steps * resolution(best, 1), (budget, best, true)
        assert outcome.predicted_peak_mb <= budget
        assert len(outcome.measurements) <= 12


def concave(batch):
    # Workspace that grows slower than the batch: a line fitted near the
    # answer lies above the curve at its ends.
    return 20.0 + 4.0 * math.sqrt(batch)


@pytest.mark.parametrize("curve", [concave, staircase, jump])
def test_the_reported_peak_never_exceeds_the_budget(curve):
    """The answer's reported peak (the fitted line's) is within the budget,
    as its measured peak is, and the answer stays within a few probe
    steps of the true largest batch."""
    for budget in (60.0, 100.0, 140.0, 300.0, 1000.0):
        outcome = search_batch_size(_measure(curve), budget)
        best = outcome.best.batch_size
        assert outcome.best.peak_mb <= budget
        assert outcome.predicted_peak_mb <= budget, (budget, outcome)
        true = _true_largest(curve, budget)
        assert true - best <= 4 * resolution(best, 1), (budget, best, true)


def test_linear_memory_is_found_exactly_in_few_steps():
    outcome = search_batch_size(_measure(linear), 100.0)
    assert outcome.best.batch_size == 1600
    assert len(outcome.measurements) <= 8
    assert outcome.fit.per_sample_mb == pytest.approx(0.05)
    assert outcome.fit.fixed_mb == pytest.approx(20.0)
    assert outcome.predicted_peak_mb == pytest.approx(100.0)


def test_first_probes_then_growth_at_most_eight_fold():
    log = []
    search_batch_size(_measure(linear, log), 1000.0)
    assert log[:2] == [1, 2]
    for before, after in zip(log, log[1:]):
        if all(linear(b) <= 1000.0 for b in log[: log.index(after)]):
            assert after <= 8 * before


def test_out_of_memory_backs_off():
    # The budget would allow 1,600, but the device runs out above 700
    # (fragmentation, another process): the search backs off.
    log = []
    outcome = search_batch_size(
        _measure(linear, log, oom_above=700), budget_mb=100.0
    )
    assert outcome.best.batch_size <= 700
    assert 700 - outcome.best.batch_size <= resolution(700, 1)
    assert any(m.out_of_memory for m in outcome.measurements)
    assert outcome.upper_bound > 700
    assert outcome.fit.per_sample_mb == pytest.approx(0.05)


def test_out_of_memory_at_the_first_probe_is_budget_too_small():
    with pytest.raises(BudgetTooSmall, match="ran out of device memory"):
        search_batch_size(_measure(linear, oom_above=0), 100.0)


def test_budget_below_fixed_cost():
    with pytest.raises(BudgetTooSmall, match="peaks at 20.1 MB") as info:
        search_batch_size(_measure(linear), 15.0, multiple_of=2)
    assert info.value.measurement.batch_size == 2


def test_max_batch_size_caps_the_answer():
    log = []
    outcome = search_batch_size(_measure(linear, log), 100.0, 500)
    assert outcome.best.batch_size == 500
    assert outcome.limited_by == "max_batch_size"
    assert max(log) == 500


def test_multiple_of():
    log = []
    outcome = search_batch_size(_measure(linear, log), 100.0, multiple_of=8)
    assert all(batch % 8 == 0 for batch in log)
    assert outcome.best.batch_size == 1600
    capped = search_batch_size(_measure(linear), 100.0, 203, multiple_of=8)
    assert capped.best.batch_size == 200


def test_trial_budget():
    outcome = search_batch_size(_measure(quadratic), 1000.0, max_trials=5)
    assert len(outcome.measurements) == 5
    assert outcome.limited_by == "trials"
    assert quadratic(outcome.best.batch_size) <= 1000.0


def test_a_failure_below_a_fit_keeps_the_answer_below_it():
    # Noise: 300 measured over the budget although 400 was under it. The
    # conservative answer stays below every failure.
    peaks = {1: 10.0, 2: 10.5, 400: 90.0, 300: 101.0, 200: 50.0}
    search = _Search(lambda b: (peaks[b], 0.0), 100.0, None, 1)
    for batch in (1, 2, 400, 300, 200):
        search.run(batch)
    candidate, _ = search.next_candidate()
    assert 200 < candidate < 300
    outcome = search.outcome("memory")
    assert outcome.best.batch_size == 200
    assert outcome.upper_bound == 300


def test_linear_fit():
    a = Measurement(100, 30.0)
    b = Measurement(300, 70.0)
    fit = LinearFit.through(a, b)
    assert (fit.fixed_mb, fit.per_sample_mb) == (10.0, 0.2)
    assert fit.largest_batch(50.0) == pytest.approx(200.0)
    assert LinearFit.through(a, a).largest_batch(50.0) == math.inf
    lsq = LinearFit.least_squares([a, b, Measurement(200, 50.0)])
    assert lsq.per_sample_mb == pytest.approx(0.2)
    assert lsq.batch_sizes == (100, 200, 300)
    single = LinearFit.least_squares([a, Measurement(100, 32.0)])
    assert (single.fixed_mb, single.per_sample_mb) == (32.0, 0.0)
    # A line that would start below zero goes through the origin.
    steep = LinearFit.least_squares([Measurement(100, 5.0), b])
    assert steep.fixed_mb == 0.0
    assert steep.per_sample_mb == pytest.approx(
        (100 * 5.0 + 300 * 70.0) / (100**2 + 300**2)
    )


def _low_then_true(curve, low):
    """A search `measure` whose few steps peak `low` times the curve (they
    happened to peak low), and a `confirm` whose longer runs peak on the
    curve."""
    confirmed = []

    def measure(batch):
        return low * curve(batch), 1e-3 * batch

    def confirm(batch):
        confirmed.append(batch)
        return curve(batch), 1e-3 * batch

    return measure, confirm, confirmed


def test_the_answer_is_confirmed_over_a_longer_run():
    budget = 100.0
    measure, confirm, confirmed = _low_then_true(linear, 0.92)
    unconfirmed = search_batch_size(measure, budget)
    # Without the confirmation the answer's training steps peak above the
    # budget: its few steps happened to peak low.
    assert linear(unconfirmed.best.batch_size) > 1.05 * budget
    outcome = search_batch_size(measure, budget, confirm=confirm)
    best = outcome.best
    assert best.confirmation
    assert best.peak_mb == linear(best.batch_size) <= budget
    # Stepped down to where the longer runs fit, within a few steps.
    true = _true_largest(linear, budget)
    assert true - best.batch_size <= 3 * resolution(true, 1)
    assert outcome.predicted_peak_mb <= budget
    assert outcome.upper_bound <= unconfirmed.best.batch_size
    assert confirmed[0] == unconfirmed.best.batch_size
    assert len(confirmed) <= 6
    flags = [m.confirmation for m in outcome.measurements]
    assert flags.count(True) == len(confirmed)


def test_a_confirmed_answer_is_kept():
    measure, confirm, confirmed = _low_then_true(linear, 1.0)
    plain = search_batch_size(_measure(linear), 100.0)
    outcome = search_batch_size(measure, 100.0, confirm=confirm)
    assert confirmed == [plain.best.batch_size]
    assert outcome.best.batch_size == plain.best.batch_size
    assert outcome.best.confirmation
    assert outcome.limited_by == plain.limited_by == "memory"


def test_a_cap_that_fails_the_longer_run_is_limited_by_memory():
    # The cap (500: 45 MB) fits the search's steps, not a longer run.
    measure, confirm, _ = _low_then_true(linear, 1.0)
    outcome = search_batch_size(
        measure, 44.0, 500, confirm=lambda b: confirm(b + 100)
    )
    assert outcome.best.batch_size < 500
    assert outcome.best.confirmation
    assert linear(outcome.best.batch_size + 100) <= 44.0
    assert outcome.limited_by == "memory"


def test_the_smallest_batch_failing_the_longer_run_is_budget_too_small():
    with pytest.raises(
        BudgetTooSmall,
        match=r"smallest batch \(1\) peaks at 24\.1 MB over a longer run",
    ) as info:
        search_batch_size(
            _measure(linear), 20.12, confirm=lambda b: (24.0 + 0.1 * b, 0.0)
        )
    assert info.value.measurement.confirmation


def test_a_failed_confirmation_steps_down_by_the_excess_not_further():
    # The search's steps: 2333 fits, 2500 does not, nothing measured
    # between 1024 and 2333, and the allocator's plateaus make the line
    # near the answer nearly flat. Over a longer run 2333 peaks 5% above
    # the budget: the answer steps down near it (as if at least half the
    # peak grew with the batch), not far down (as the flat line says).
    peaks = {1: 20.0, 2: 20.1, 1024: 97.0, 2333: 98.0, 2500: 101.0}
    search = _Search(lambda b: (peaks[b], 0.0), 100.0, None, 1)
    for batch in peaks:
        search.run(batch)
    confirmed = []

    def confirm(batch):
        confirmed.append(batch)
        return 20.0 + 0.0364 * batch, 0.0  # 104.9 MB at 2333

    search.confirm(confirm)
    outcome = search.outcome("memory")
    assert confirmed[0] == 2333 and len(confirmed) <= 3
    assert outcome.best.confirmation
    assert 2000 < outcome.best.batch_size < 2333
    assert outcome.best.peak_mb <= 100.0
    assert outcome.predicted_peak_mb <= 100.0
    assert len(confirmed) >= 2 and outcome.upper_bound == confirmed[-2]


def test_a_confirmation_spread_lowers_the_budget_and_steps_down():
    # The line 10 + 0.5 b fits 100 MB up to 180; a confirmation whose
    # steps spread by 6 MB holds the search to 100 - 2 x 6 = 88 MB.
    from keras_mgpu.batch_size.search import search_batch_size

    def line(batch):
        return 10.0 + 0.5 * batch, 0.01

    seen = []

    def budget_for(measurement, fixed_mb):
        seen.append((measurement.batch_size, measurement.spread, fixed_mb))
        return 100.0 - 2 * measurement.spread

    outcome = search_batch_size(
        line,
        100.0,
        confirm=lambda batch: (*line(batch), 6.0),
        confirm_budget=budget_for,
    )
    assert outcome.budget_mb == 88.0
    assert outcome.best.peak_mb <= 88.0
    assert outcome.best.confirmation and outcome.best.spread == 6.0
    assert outcome.best.batch_size >= 156 - 6  # within a step or so of 156
    assert seen[0] == (180, 6.0, pytest.approx(10.0))
    assert outcome.predicted_peak_mb <= 88.0

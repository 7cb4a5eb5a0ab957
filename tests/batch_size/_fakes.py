"""A fake allocator for the batch-size probe, so its search, back-off and
agreement run in the test process, with or without CPU allocator
statistics there (TensorFlow keeps them only with oneDNN on, its default on
some CPUs). The training steps themselves are real."""

from __future__ import annotations

import pytest

from keras_mgpu._flavour import tf
from keras_mgpu.batch_size import finder, memory_probe
from keras_mgpu.batch_size.finder import MIN_SAFETY_MARGIN as SAFETY_MARGIN


class FakeAllocator:
    """`peak = fixed_mb + per_sample_mb * batch` of the last step, plus
    `long_run_mb` in a run of more than `memory_probe.STEPS` steps (a
    training run's spread of step peaks); a step above `oom_above` raises
    TensorFlow's out-of-memory error (as a GPU does when fragmentation
    leaves less than the budget says)."""

    def __init__(
        self,
        fixed_mb: float = 10.0,
        per_sample_mb: float = 0.5,
        oom_above: int | None = None,
        capacity_mb: float | None = None,
        stats: bool = True,
        long_run_mb: float = 0.0,
    ) -> None:
        self.fixed_mb = fixed_mb
        self.per_sample_mb = per_sample_mb
        self.oom_above = oom_above
        self.capacity = capacity_mb
        self.stats = stats
        self.long_run_mb = long_run_mb
        self.batch = 0
        self.count = 0
        self.steps: list[int] = []
        self.step_counts: list[int] = []
        self.probe_strategies: list = []
        self.probe_optimizers: list = []

    def peak(self, batch: int) -> float:
        extra = self.long_run_mb if self.count > memory_probe.STEPS else 0.0
        return self.fixed_mb + self.per_sample_mb * batch + extra

    def read(self, device: str):
        if not self.stats:
            return None
        return {"current_mb": 0.0, "peak_mb": self.peak(self.batch)}

    def reset(self, device: str) -> bool:
        return self.stats

    def capacity_mb(self, device: str):
        return self.capacity


def largest_fitting(
    budget_mb: float,
    multiple_of: int = 1,
    fixed_mb: float = 10.0,
    per_sample_mb: float = 0.5,
) -> int:
    """The largest multiple of `multiple_of` whose fake peak `fixed_mb +
    per_sample_mb * batch` fits `budget_mb` less `SAFETY_MARGIN`: the
    search's answer on the fake's exact line (tests derive their figures
    from it, so a different margin changes no verdict)."""
    room = budget_mb * (1 - SAFETY_MARGIN) - fixed_mb
    batch = int(room / per_sample_mb + 1e-9)
    return batch - batch % multiple_of


def budget_for(batch_size: int, fixed_mb: float = 10.0) -> float:
    """A budget whose search budget (less `SAFETY_MARGIN`) holds the fake's
    peak at `batch_size` but not at `batch_size + 1` (0.1 MB to spare)."""
    return (fixed_mb + 0.5 * batch_size + 0.2) / (1 - SAFETY_MARGIN)


@pytest.fixture
def fake_allocator(monkeypatch):
    """Install a `FakeAllocator` (returned; change its fields freely).

    The fake's steps have no spread and no part that varies between steps,
    so the default margin is the least one (`MIN_SAFETY_MARGIN`): the
    share of the batch-dependent part it keeps on real runs
    (`finder.VARIABLE_SHARE`) is set to 0 here and tested on its own."""
    fake = FakeAllocator()
    monkeypatch.setattr(finder, "VARIABLE_SHARE", 0.0)
    monkeypatch.setattr(memory_probe, "memory_reader", lambda: fake)
    real_steps = memory_probe.StepProbe._run_steps

    def steps(self, batch_size, inputs, count):
        fake.batch, fake.count = batch_size, count
        fake.steps.append(batch_size)
        fake.step_counts.append(count)
        fake.probe_strategies.append(self.model.distribute_strategy)
        fake.probe_optimizers.append(self.model.optimizer)
        if fake.oom_above is not None and batch_size > fake.oom_above:
            raise tf.errors.ResourceExhaustedError(
                None, None, "OOM when allocating tensor (fake)"
            )
        return real_steps(self, batch_size, inputs, count)

    monkeypatch.setattr(memory_probe.StepProbe, "_run_steps", steps)
    return fake

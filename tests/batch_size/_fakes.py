"""A fake allocator for the batch-size probe, so its search, back-off and
agreement run in the test process, with or without CPU allocator
statistics there (TensorFlow keeps them only with oneDNN on, its default on
some CPUs). The training steps themselves are real."""

from __future__ import annotations

import pytest

from keras_mgpu._flavour import tf
from keras_mgpu.batch_size import memory_probe


class FakeAllocator:
    """`peak = fixed_mb + per_sample_mb * batch` of the last step; a step
    above `oom_above` raises TensorFlow's out-of-memory error (as a GPU
    does when fragmentation leaves less than the budget says)."""

    def __init__(
        self,
        fixed_mb: float = 10.0,
        per_sample_mb: float = 0.5,
        oom_above: int | None = None,
        capacity_mb: float | None = None,
        stats: bool = True,
    ) -> None:
        self.fixed_mb = fixed_mb
        self.per_sample_mb = per_sample_mb
        self.oom_above = oom_above
        self.capacity = capacity_mb
        self.stats = stats
        self.batch = 0
        self.steps: list[int] = []
        self.probe_strategies: list = []
        self.probe_optimizers: list = []

    def peak(self, batch: int) -> float:
        return self.fixed_mb + self.per_sample_mb * batch

    def read(self, device: str):
        if not self.stats:
            return None
        return {"current_mb": 0.0, "peak_mb": self.peak(self.batch)}

    def reset(self, device: str) -> bool:
        return self.stats

    def capacity_mb(self, device: str):
        return self.capacity


@pytest.fixture
def fake_allocator(monkeypatch):
    """Install a `FakeAllocator` (returned; change its fields freely)."""
    fake = FakeAllocator()
    monkeypatch.setattr(memory_probe, "memory_reader", lambda: fake)
    real_steps = memory_probe.StepProbe._run_steps

    def steps(self, batch_size, inputs):
        fake.batch = batch_size
        fake.steps.append(batch_size)
        fake.probe_strategies.append(self.model.distribute_strategy)
        fake.probe_optimizers.append(self.model.optimizer)
        if fake.oom_above is not None and batch_size > fake.oom_above:
            raise tf.errors.ResourceExhaustedError(
                None, None, "OOM when allocating tensor (fake)"
            )
        return real_steps(self, batch_size, inputs)

    monkeypatch.setattr(memory_probe.StepProbe, "_run_steps", steps)
    return fake

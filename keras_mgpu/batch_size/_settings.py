"""What one batch-size search is asked: the options `find_batch_size` and
`configure_batch` pass to the search, one object for both backends' searches
(`finder.probe_batch_size` on TensorFlow, `compiled_search.probe_compiled`
on JAX)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class ProbeSettings:
    """The search's options (see `find_batch_size` for each one's meaning);
    `accumulate` wraps the copy's optimizer in
    `GradientAccumulationOptimizer` (for `configure_batch`)."""

    memory_fraction: float | None
    max_batch_size: int | None
    device: str | None
    memory_budget_mb: float | None
    multiple_of: int
    strategy: Any
    max_trials: int
    verbose: int
    accumulate: bool
    safety_margin: float | None = None

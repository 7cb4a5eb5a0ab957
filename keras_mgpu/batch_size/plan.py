"""`plan_batch`: split a target global batch exactly into per-replica
micro-batches and accumulation steps."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from keras_mgpu._validation import (
    check_at_most_one,
    check_int,
    check_number,
    reject_unknown,
    renamed_argument,
)
from keras_mgpu.distribute import num_replicas_in_sync

DEFAULT_MIN_FILL = 0.5


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """`global_batch_size = per_replica_batch_size * num_replicas *
    accumulation_steps`, exactly.

    Attributes:
        per_replica_batch_size: each replica's micro-batch.
        accumulation_steps: micro-batches per optimizer update.
        num_replicas: replicas in sync (every worker's).
        global_batch_size: examples per optimizer update.
        max_batch_size: the largest per-replica micro-batch that fits
            (`max_per_replica_batch` before 0.2, still readable until 0.3).
    """

    per_replica_batch_size: int
    accumulation_steps: int
    num_replicas: int
    global_batch_size: int
    max_batch_size: int

    @property
    def max_per_replica_batch(self) -> int:
        """Deprecated name of `max_batch_size` (until 0.3)."""
        return self.max_batch_size

    @property
    def step_batch_size(self) -> int:
        """The batch of one `fit` step (all replicas): what to give
        `dataset.batch(...)` or `fit(batch_size=...)`."""
        return self.per_replica_batch_size * self.num_replicas

    @property
    def fill(self) -> float:
        """The micro-batch as a fraction of the largest that fits."""
        return self.per_replica_batch_size / self.max_batch_size

    def __str__(self) -> str:
        return (
            f"{self.global_batch_size} = {self.per_replica_batch_size} per "
            f"replica x {self.num_replicas} replica(s) x "
            f"{self.accumulation_steps} accumulation step(s)"
        )


class NoExactSplitError(ValueError):
    """No exact split of the global batch is worth using.

    `nearest` holds the plans of the nearest global batch sizes, below and
    above, that have one.
    """

    def __init__(self, message: str, nearest: tuple[BatchPlan, ...]) -> None:
        super().__init__(message)
        self.nearest = nearest


def plan_batch(
    global_batch_size: int,
    max_batch_size: int | None = None,
    strategy: Any = None,
    *,
    num_replicas: int | None = None,
    min_fill: float = DEFAULT_MIN_FILL,
    **deprecated: Any,
) -> BatchPlan:
    """Split `global_batch_size` into replicas x accumulation steps x
    micro-batches of at most `max_batch_size`, exactly.

    Takes the fewest accumulation steps K for which the per-replica share
    `global / replicas` divides into K equal micro-batches that fit:
    the largest micro-batch, the fewest micro-steps. With K > 1 the
    micro-batch must also be at least `min_fill` of the largest that fits,
    or the run would crawl through tiny micro-batches (4,099 samples on one
    replica with room for 512 split exactly only as 4,099 x 1).

    Args:
        global_batch_size: int >= 1, examples per optimizer update.
        max_batch_size: int >= 1, the largest per-replica micro-batch that
            fits (called `max_per_replica_batch` before 0.2; the old name
            works, with a `FutureWarning`, until 0.3)
            (e.g. `find_batch_size(...).batch_size`).
        strategy: the strategy whose replicas are counted (all workers');
            defaults to the one in scope.
        num_replicas: int >= 1, instead of `strategy`.
        min_fill: float in [0, 1], see above (default 0.5; 0 accepts any
            exact split).

    Returns:
        A `BatchPlan`.

    Raises:
        NoExactSplitError: the global batch is not a multiple of the
            replica count, or its exact splits use micro-batches below
            `min_fill`; the message and `.nearest` give the nearest global
            batches that split well.

    Example:

    ```python
    plan = keras_mgpu.plan_batch(4096, max_batch_size=300,
                                 num_replicas=2)
    plan.per_replica_batch_size, plan.accumulation_steps   # (256, 8)
    ```
    """
    check_int(global_batch_size, "global_batch_size", minimum=1)
    max_batch_size = renamed_argument(
        "plan_batch",
        deprecated,
        "max_per_replica_batch",
        "max_batch_size",
        max_batch_size,
        None,
    )
    reject_unknown("plan_batch", deprecated)
    check_int(max_batch_size, "max_batch_size", minimum=1)
    check_number(min_fill, "min_fill", minimum=0.0, maximum=1.0)
    check_at_most_one(("strategy", strategy), ("num_replicas", num_replicas))
    if num_replicas is None:
        num_replicas = num_replicas_in_sync(strategy)
    check_int(num_replicas, "num_replicas", minimum=1)
    plan = best_split(global_batch_size, max_batch_size, num_replicas, min_fill)
    if plan is not None:
        return plan
    nearest = nearest_splits(
        global_batch_size, max_batch_size, num_replicas, min_fill
    )
    raise NoExactSplitError(
        _no_split_message(
            global_batch_size, max_batch_size, num_replicas, min_fill
        )
        + " Nearest that split: "
        + "; ".join(str(p) for p in nearest)
        + ".",
        nearest,
    )


def best_split(
    global_batch_size: int, max_batch: int, replicas: int, min_fill: float
) -> BatchPlan | None:
    """The exact split with the fewest accumulation steps, or None."""
    if global_batch_size % replicas:
        return None
    share = global_batch_size // replicas
    smallest_useful = max(1, math.ceil(min_fill * max_batch))
    for steps in range(math.ceil(share / max_batch), share + 1):
        if share % steps:
            continue
        micro = share // steps
        if steps > 1 and micro < smallest_useful:
            return None  # later divisors only give smaller micro-batches
        return BatchPlan(micro, steps, replicas, global_batch_size, max_batch)
    return None  # pragma: no cover - steps == share always divides


def nearest_splits(
    global_batch_size: int, max_batch: int, replicas: int, min_fill: float
) -> tuple[BatchPlan, ...]:
    """The plans of the nearest global batches below and above
    `global_batch_size` that split (below only if one exists)."""
    found = []
    for direction in (-1, 1):
        size = global_batch_size + direction
        while size >= 1:
            plan = best_split(size, max_batch, replicas, min_fill)
            if plan is not None:
                found.append(plan)
                break
            size += direction
    return tuple(found)


def _no_split_message(
    global_batch_size: int, max_batch: int, replicas: int, min_fill: float
) -> str:
    head = f"Argument `global_batch_size`={global_batch_size} "
    if global_batch_size % replicas:
        return (
            head + f"is not a multiple of the {replicas} replicas in sync, "
            "so no per-replica batch and accumulation steps give it exactly."
        )
    exact = best_split(global_batch_size, max_batch, replicas, 0.0)
    return (
        head + f"splits exactly only into micro-batches of "
        f"{exact.per_replica_batch_size} (x {exact.accumulation_steps} "
        f"accumulation steps on {replicas} replica(s)), under "
        f"min_fill={min_fill:g} of the {max_batch} that fit per replica "
        "(pass min_fill=0 to accept it)."
    )

"""Gather every worker's monitor figures onto every worker (the chief
included), with two small collectives per call: all-reduces of
`tf.distribute` on TensorFlow, `process_allgather` across JAX processes."""

from __future__ import annotations

import re
import zlib
from typing import Any

import numpy as np

from keras_mgpu import backend
from keras_mgpu._validation import check_bool

_WORKER_KEY = re.compile(r"^(?P<group>[a-z]+)/w(?P<task>\d+)_(?P<name>.+)$")


class KeysDiffer(ValueError):
    """The workers log different key sets (different devices)."""


def gather_worker_figures(
    figures: dict[str, float], strategy: Any, task_id: int, num_workers: int
) -> dict[str, float]:
    """All workers' figures, keyed `group/w<task>_name`, on every worker.

    `figures` are this worker's, keyed with its own `w<task_id>_` prefix.
    Every worker must call this at the same point (the end of an epoch of
    synchronous training is one). Each worker fills its own row of a
    `[num_workers, len(figures)]` float64 matrix, zeros elsewhere; a SUM
    all-reduce gives every worker the whole matrix exactly (each cell has
    one non-zero term). On JAX (`strategy` is the `keras.distribution` in
    force, or None) each process's row is all-gathered instead, bit for
    bit. Raises `KeysDiffer` when the workers' key sets differ, found by a
    first, fixed-size exchange of each worker's key count and key-set
    checksum.
    """

    names = []
    for key in sorted(figures):
        match = _WORKER_KEY.match(key)
        if match is None or int(match["task"]) != task_id:
            raise ValueError(  # a bug in a caller
                f"Key {key!r} does not carry this worker's prefix w{task_id}_"
            )
        names.append((match["group"], match["name"]))
    # First a fixed-size header (key count and key-set checksum): the
    # matrix below can only be all-reduced if every worker's has the same
    # shape. Integers below 2**32 sum exactly in float64, and the sums
    # equal num_workers times ours only if every worker's header is ours.
    header = np.array(
        [len(names), zlib.crc32(repr(names).encode())], dtype=np.float64
    )
    headers = _all_rows(strategy, header, task_id, num_workers)
    if not np.array_equal(headers.sum(axis=0), num_workers * header):
        raise KeysDiffer(
            "the workers log different figures (different devices?)"
        )
    row = np.array(
        [figures[f"{g}/w{task_id}_{n}"] for g, n in names], dtype=np.float64
    )
    total = _all_rows(strategy, row, task_id, num_workers)
    gathered = {}
    for worker in range(num_workers):
        for column, (group, name) in enumerate(names):
            gathered[f"{group}/w{worker}_{name}"] = float(total[worker, column])
    return gathered


def _all_rows(
    strategy: Any, row: np.ndarray, task_id: int, num_workers: int
) -> np.ndarray:
    """Every worker's `row`, stacked by rank, on every worker (a collective:
    each worker calls it at the same point)."""
    if backend.is_jax():
        from keras_mgpu.backend.jax.processes import allgather_rows

        return allgather_rows(row)
    from keras_mgpu.distribute.collectives import sum_over_workers

    matrix = np.zeros((num_workers, row.size), dtype=np.float64)
    matrix[task_id] = row
    return sum_over_workers(strategy, matrix)


class WorkerGathering:
    """A monitor's `gather_workers` option, shared by both monitors.

    `start(strategy, prefix_option)` at train begin decides whether to
    gather (a cluster of several workers) and returns the key prefix;
    `expand_keys` lists every worker's keys;
    `gather(figures)` returns every worker's figures, or this worker's own
    with a warning (once) when the workers' key sets differ.
    """

    def __init__(self, enabled: bool, owner: str) -> None:
        self.enabled = check_bool(enabled, "gather_workers")
        self._owner = owner
        self._strategy = None
        self._jax_active = False
        self.task_id = 0
        self.num_workers = 1

    def start(
        self, strategy: Any, prefix_option: bool | None, notices: Any = None
    ) -> str:
        """Decide whether figures are gathered in this run; return this
        worker's key prefix (`prefix_option` is the monitor's
        `worker_prefix`, forced on while gathering)."""
        from keras_mgpu._flavour import tf
        from keras_mgpu.distribute import worker_info
        from keras_mgpu.monitoring.log_keys import worker_prefix

        info = worker_info(strategy)
        self.task_id = int(info["rank"] or 0)
        self.num_workers = int(info["num_workers"])
        # A task outside the collective (an `evaluator`) runs alone: it
        # logs its own figures under its own prefix, and gathers nothing.
        member = info["rank"] is not None
        active = self.enabled and self.num_workers > 1 and member
        if backend.is_jax():
            # Every JAX process runs the callbacks of one program: in step.
            pass
        elif active and not isinstance(
            strategy, tf.distribute.MultiWorkerMirroredStrategy
        ):
            # Parameter-server workers run no callbacks (the coordinator
            # does): there is nothing to exchange in step.
            if notices is not None:
                notices.warn(
                    "gather-strategy",
                    f"{self._owner}: gather_workers needs "
                    "MultiWorkerMirroredStrategy (synchronous workers); "
                    f"under {type(strategy).__name__} each process logs "
                    "its own figures.",
                )
            active = False
        self._strategy = strategy if active else None
        # On JAX the processes need no strategy object to exchange figures
        # (there may be no distribution in force).
        self._jax_active = active and backend.is_jax()
        return worker_prefix(True if active else prefix_option, strategy)

    @property
    def active(self) -> bool:
        return self._strategy is not None or self._jax_active

    def expand_keys(self, keys: list[str]) -> list[str]:
        if not self.active:
            return keys
        own = f"/w{self.task_id}_"
        return [
            key.replace(own, f"/w{worker}_", 1)
            for worker in range(self.num_workers)
            for key in keys
        ]

    def gather(self, figures: dict[str, float], notices: Any) -> dict:
        if not self.active:
            return figures
        try:
            return gather_worker_figures(
                figures, self._strategy, self.task_id, self.num_workers
            )
        except KeysDiffer as exc:
            notices.warn(
                "gather",
                f"{self._owner}: not gathering the workers' figures: {exc}; "
                "each worker logs its own.",
            )
            return figures

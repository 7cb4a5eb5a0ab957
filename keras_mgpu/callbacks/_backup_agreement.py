"""How `BackupAndRestore`'s workers agree before any of them trains: one
small gather of every worker's row (success, then a digest), and the same
error on every worker where they differ."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np

from keras_mgpu.backend import is_jax


def _gather_rows(strategy: Any, row: list[float]) -> Any:
    """Every worker's `row`, in rank order, on every worker: one small
    collective (TensorFlow: an all-reduce of `strategy`; JAX: an
    all-gather across `jax.distributed`'s processes)."""
    if is_jax():
        from keras_mgpu.backend.jax.processes import allgather_rows

        return allgather_rows(row)
    from keras_mgpu.distribute.collectives import gather_rows

    return gather_rows(strategy, row)


def _weights_bytes(model: Any) -> bytes:
    """The model's weights and optimizer step counter, as bytes."""

    parts = [np.ascontiguousarray(w).tobytes() for w in model.get_weights()]
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and getattr(optimizer, "built", False):
        parts.append(np.asarray(optimizer.iterations).tobytes())
    return b"".join(parts)


def _sha256_words(data: str | bytes) -> list[float]:
    """A SHA-256 as 4 words of 48 bits, each exact in float64 (the
    all-reduce of `gather_rows` is in float64)."""
    if isinstance(data, str):
        data = data.encode()
    hexdigest = hashlib.sha256(data).hexdigest()
    return [float(int(hexdigest[12 * i : 12 * i + 12], 16)) for i in range(4)]


def _processes(ranks: list[int]) -> str:
    return ("process " if len(ranks) == 1 else "processes ") + ", ".join(
        str(r) for r in ranks
    )


def _agree(
    strategy: Any,
    error: str | None,
    identity: list[float],
    failure: str,
    remedy: str,
    differ: Callable[[Any], str],
) -> None:
    """Gather every worker's `error` (None: it succeeded) and `identity`
    (one row each: success, then the identity) and raise the same
    ValueError on every worker where one failed ("worker 1 <failure> (this
    worker's error). <remedy>") or the identities differ (`differ(rows)`),
    so that every worker starts training, or none."""
    rows = _gather_rows(strategy, [float(error is None), *identity])
    failed = [r for r in range(len(rows)) if rows[r, 0] == 0]
    if failed:
        raise ValueError(
            f"{_workers(failed)} {failure}"
            + (f" ({error})" if error else "")
            + f". {remedy}"
        )
    if len({tuple(r[1:]) for r in rows}) > 1:
        raise ValueError(differ(rows))


def _hex(words: Any) -> str:
    return "".join(f"{int(w):012x}" for w in words)[:12]


def _workers(ranks: list[int]) -> str:
    return ("worker " if len(ranks) == 1 else "workers ") + ", ".join(
        str(r) for r in ranks
    )

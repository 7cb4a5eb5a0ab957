"""What `BackupAndRestore` needs from JAX across processes: an exact
all-gather of small rows (the processes' agreement on a backup) and the
check that process 0 alone can read the whole training state.

Under `keras.distribution.DataParallel` every variable is replicated on
every device of every process: process 0 holds the whole state and writes
it alone; every process reads the same file at a restore. A variable split
across processes (a `ModelParallel` layout whose model axis spans several
processes) has parts no single process can read: saving it would need a
gather collective inside `save_weights`, which Keras does not do.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def several_processes() -> bool:
    """Whether `jax.distributed` runs several processes (asked only once it
    is initialised: counting earlier would start JAX's backends and make
    `keras.distribution.initialize()` fail)."""
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


def gather_rows(row: Any) -> np.ndarray:
    """Every process's `row` as a `[process_count, len(row)]` float64
    matrix, in process order, on every process (`row[None]` on one).

    A collective: every process calls it at the same point, with rows of
    the same length. Exact: the float64 values travel as pairs of uint32
    words (JAX without `jax_enable_x64` would round float64 to float32).
    """
    row = np.ascontiguousarray(np.asarray(row, dtype=np.float64).reshape(-1))
    if not several_processes():
        return row[None]
    from jax.experimental import multihost_utils

    words = row.view(np.uint32)
    gathered = np.asarray(multihost_utils.process_allgather(words))
    return np.ascontiguousarray(
        gathered.reshape(-1, words.size).astype(np.uint32)
    ).view(np.float64)


def unreadable_variables(variables: Any) -> list[str]:
    """The paths of the variables that this process cannot read whole:
    arrays split across processes (not fully replicated and not fully
    addressable). Empty under `DataParallel` and in one process."""
    names = []
    for variable in variables:
        value = getattr(variable, "value", variable)
        if callable(value):  # not a Keras variable: the array itself
            value = variable
        addressable = getattr(value, "is_fully_addressable", True)
        replicated = getattr(value, "is_fully_replicated", True)
        if not addressable and not replicated:
            names.append(str(getattr(variable, "path", variable)))
    return names

"""What `BackupAndRestore` needs from JAX across processes: an exact
all-gather of small rows (the processes' agreement on a backup) and the
check that every process can read the whole training state.

Under `keras.distribution.DataParallel` every variable is replicated on
every device of every process: process 0 holds the whole state and writes
it; the others save privately (Keras's `save_weights` creates variables, a
collective every process must join) and every process reads the same file
at a restore. A variable split across processes (a `ModelParallel` layout
whose model axis spans several processes' devices) has parts no single
process holds: `save_weights` fails on it ("Fetching value for `jax.Array`
that spans non-addressable devices"), Keras does not gather.
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
    """The paths of the variables that some process cannot read whole:
    one of whose parts (shards) is on no device of that process. Empty
    under `DataParallel` (replicated) and in one process; also for a
    `ModelParallel` whose model axis stays within each process (JAX reads
    such an array from the local shards). The same answer on every
    process: it reads the layouts, which every process shares."""
    return [
        str(getattr(variable, "path", variable))
        for variable in variables
        if not _every_process_holds_all(getattr(variable, "value", variable))
    ]


def _every_process_holds_all(array: Any) -> bool:
    """Whether every process holds every part of `array` (True for
    something that is not a sharded JAX array)."""
    sharding = getattr(array, "sharding", None)
    if sharding is None:
        return True
    held: dict[int, set] = {}
    for device, index in sharding.devices_indices_map(
        tuple(array.shape)
    ).items():
        held.setdefault(device.process_index, set()).add(_key(index))
    every = set().union(*held.values())
    return all(parts == every for parts in held.values())


def _key(index: tuple) -> tuple:
    """A shard's index (a tuple of slices) as something hashable."""
    return tuple(
        (s.start, s.stop, s.step) if isinstance(s, slice) else s for s in index
    )

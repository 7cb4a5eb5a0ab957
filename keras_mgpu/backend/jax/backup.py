"""What `BackupAndRestore` needs from JAX across processes: an exact
gather of small rows (the processes' agreement on a backup) and the
check that the training state is replicated.

Under `keras.distribution.DataParallel` every variable is replicated on
every device of every process: process 0 holds the whole state and writes
it; the others save privately (Keras's `save_weights` creates variables, a
collective every process must join) and every process reads the same file
at a restore. A variable split across processes (a `ModelParallel` layout
whose model axis spans several processes' devices) has parts no single
process holds: `save_weights` fails on it ("Fetching value for `jax.Array`
that spans non-addressable devices"), Keras does not gather. With the
model axis within each process, a multi-process `fit` with a backup did not
finish in our tests: sharded state is refused across processes.
"""

from __future__ import annotations

import itertools
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

    Every process calls it at the same point of the program, the same
    number of times. The rows travel through `jax.distributed`'s
    key-value store (the coordination service), not an XLA collective: no
    compiled program runs, so nothing can interleave with the computations
    of a `fit` in flight on the devices (an all-gather through gloo did,
    measured under a `ModelParallel`: "collective mismatch"), the values
    come back bit-exact (float64 bytes; JAX without `jax_enable_x64` rounds
    float64 arrays to float32), and the wait is bounded (`_WAIT_MS`; a
    dead process also stops this one through JAX's heartbeat).
    """
    row = np.ascontiguousarray(np.asarray(row, dtype=np.float64).reshape(-1))
    if not several_processes():
        return row[None]
    import jax

    client = _client()
    call = next(_CALLS)
    prefix = f"keras_mgpu/backup_rows/{call}"
    client.key_value_set(f"{prefix}/{jax.process_index()}", row.tobytes().hex())
    rows = [
        np.frombuffer(
            bytes.fromhex(
                client.blocking_key_value_get(f"{prefix}/{index}", _WAIT_MS)
            ),
            dtype=np.float64,
        )
        for index in range(jax.process_count())
    ]
    return np.stack(rows)


# Calls so far in this process: the same sequence on every process, so
# call n's keys name the same exchange everywhere.
_CALLS = itertools.count()
_WAIT_MS = 600_000  # a live process that never comes: an error, not a hang


def _client() -> Any:
    """The client of `jax.distributed`'s coordination service. Private JAX
    state (`jax._src.distributed.global_state`, jax 0.4.x to 0.10.2): a
    clear error where it moved."""
    try:
        from jax._src.distributed import global_state
    except ImportError as exc:  # pragma: no cover - a JAX that moved it
        raise RuntimeError(
            "keras_mgpu's BackupAndRestore needs jax.distributed's key-value "
            "store (jax._src.distributed.global_state.client), which this "
            "JAX version does not have."
        ) from exc
    client = global_state.client
    if client is None or not hasattr(client, "blocking_key_value_get"):
        raise RuntimeError(
            "jax.distributed's key-value store is not available: start the "
            "cluster with keras_mgpu.distribute.start_cluster() or "
            "keras.distribution.initialize()."
        )
    return client


def sharded_variables(variables: Any) -> list[str]:
    """The paths of the variables that are not replicated on every device
    (sharded by a `ModelParallel` layout). Empty under `DataParallel`."""
    return [
        str(getattr(variable, "path", variable))
        for variable in variables
        if not _replicated(getattr(variable, "value", variable))
    ]


def _replicated(array: Any) -> bool:
    sharding = getattr(array, "sharding", None)
    return sharding is None or bool(sharding.is_fully_replicated)

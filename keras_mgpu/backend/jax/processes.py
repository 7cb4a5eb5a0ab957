"""What the cluster monitors need from a multi-process JAX run: each
process's name, rows of figures gathered from every process, and ending
this process when a peer is lost (JAX cannot abort a collective).
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import sys
from typing import Any

import numpy as np

#: The exit status of a process `WorkerWatchdog` ends on JAX (EX_TEMPFAIL:
#: a temporary failure, run the job again).
EXIT_CODE = 75


def process_name(rank: int, own: bool = False) -> str:
    """ "process:1"; this process's own name also carries its host and
    process id ("process:0 (host, pid 123)"), which its peers read from its
    status."""
    if not own:
        return f"process:{rank}"
    return f"process:{rank} ({socket.gethostname()}, pid {os.getpid()})"


def several_processes() -> bool:
    """Whether `jax.distributed` runs several processes (asked only once it
    is initialised: counting earlier would start JAX's backends and make
    `keras.distribution.initialize()` fail)."""
    import jax

    return jax.distributed.is_initialized() and jax.process_count() > 1


def allgather_rows(row: Any) -> np.ndarray:
    """Every process's `row` (the same length everywhere) as a
    `[process_count, len(row)]` float64 matrix, in process order, on every
    process (`row[None]` in one process).

    Every process calls it at the same point of the program, the same
    number of times (`BackupAndRestore`'s agreement, the monitors' epoch
    figures). The rows travel through `jax.distributed`'s key-value store
    (`kv_store.client()`), not an XLA collective: no compiled program runs,
    so nothing interleaves with the computations of a `fit` in flight (an
    all-gather through gloo did, under a multi-process `ModelParallel`:
    "collective mismatch"); the values come back bit-exact (float64 bytes;
    JAX without `jax_enable_x64` rounds float64 arrays to float32), and the
    wait is bounded (`_WAIT_MS`; a dead process also ends this one through
    JAX's heartbeat). A process deletes its key of two exchanges back,
    which every process has read by then.
    """
    row = np.ascontiguousarray(np.asarray(row, dtype=np.float64).reshape(-1))
    if not several_processes():
        return row[None]
    import jax

    from keras_mgpu.backend.jax.kv_store import client

    kv = client()
    call = next(_CALLS)
    me = jax.process_index()
    kv.key_value_set(f"{_PREFIX}/{call}/{me}", row.tobytes().hex())
    rows = [
        np.frombuffer(
            bytes.fromhex(
                kv.blocking_key_value_get(f"{_PREFIX}/{call}/{index}", _WAIT_MS)
            ),
            dtype=np.float64,
        )
        for index in range(jax.process_count())
    ]
    if call >= 2:
        # Every process has set its key of exchange `call`, so it has read
        # all of exchange `call - 1` and `call - 2` before.
        try:
            kv.key_value_delete(f"{_PREFIX}/{call - 2}/{me}")
        except Exception:  # a key already gone: nothing to free
            pass
    return np.stack(rows)


# Exchanges so far in this process: the same sequence on every process, so
# exchange n's keys name the same exchange everywhere.
_CALLS = itertools.count()
_PREFIX = "keras_mgpu/rows"
_WAIT_MS = 600_000  # a live process that never comes: an error, not a hang


def exit_process(message: str) -> None:
    """Log `message` and end this process with `EXIT_CODE`.

    On JAX a process waiting for a lost or stalled peer sits in a gloo
    (or NCCL) collective inside XLA: nothing can make that call return or
    raise (JAX's own heartbeat ends the survivors with SIGABRT, but only
    after `heartbeat_timeout`, and never for a live but stalled peer).
    `os._exit` ends the process without waiting for that thread; the
    launcher restarts the job and `BackupAndRestore` resumes it.
    """
    text = (
        f"{message} This process exits with status {EXIT_CODE}: on JAX a "
        "collective waiting for a missing process cannot be aborted."
    )
    logger = logging.getLogger("keras_mgpu")
    try:
        if logger.hasHandlers():
            logger.error(text)
        else:  # logging is not configured: straight to stderr
            sys.stderr.write(text + "\n")
        sys.stderr.flush()
        sys.stdout.flush()
    except Exception:  # a closed stream: exit all the same
        pass
    os._exit(EXIT_CODE)

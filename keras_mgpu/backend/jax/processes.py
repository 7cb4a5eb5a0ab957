"""What the cluster monitors need from a multi-process JAX run: each
process's name, rows of figures gathered from every process, and ending
this process when a peer is lost (JAX cannot abort a collective).
"""

from __future__ import annotations

import logging
import os
import socket
import sys

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


def allgather_rows(row: np.ndarray) -> np.ndarray:
    """Every process's float64 `row` (the same length everywhere), stacked
    by process index: a collective every process must call at the same
    point. The bits travel as int32 pairs, so values arrive exactly
    whatever `jax_enable_x64` says."""
    from jax.experimental import multihost_utils

    row = np.ascontiguousarray(row, dtype=np.float64)
    bits = row.view(np.int32)
    gathered = np.asarray(multihost_utils.process_allgather(bits))
    gathered = np.ascontiguousarray(gathered.reshape(-1, bits.size))
    return gathered.view(np.float64).reshape(-1, row.size)


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

"""Start a JAX cluster whose processes may die (`WorkerWatchdog` ends them
with status 75, JAX aborts them, a test SIGKILLs one): every process's exit
status, the wall time it ended, its output and its result (None when it
did not return), within a bound, with nothing left behind.

`keras_mgpu.testing.run_workers` stops a cluster as soon as one process
fails, which is what a test of a failure must not do; `run_jax_cluster`
beside it in `keras_mgpu.testing.workers` waits for every end, on the same
pieces (Keras's `KERAS_DISTRIBUTION_*` variables on 127.0.0.1, the child
entry point that joins the cluster, process groups, the reaper).
"""

from __future__ import annotations

from keras_mgpu.testing.workers import run_jax_cluster

__all__ = ["run_jax_cluster"]

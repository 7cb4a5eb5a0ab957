"""Start a JAX cluster whose processes may die (`WorkerWatchdog` ends them
with status 75, JAX aborts them, a test SIGKILLs one): every process's exit
status, the wall time it ended, its output and its result (None when it
did not return), within a bound, with nothing left behind.

`keras_mgpu.testing.run_workers` stops a cluster as soon as one process
fails, which is what a test of a failure must not do; this runner reuses its
pieces (Keras's `KERAS_DISTRIBUTION_*` variables on 127.0.0.1, the child
entry point that joins the cluster, process groups, the reaper).
"""

from __future__ import annotations

import os
import pickle
import time
from typing import Any

from keras_mgpu.testing import workers


def run_jax_cluster(
    target: str,
    num_processes: int,
    *args: Any,
    timeout: float,
    cpu_devices: int = 2,
    may_hang: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """Run `target(*args)` in every process of a fresh JAX cluster; wait
    until all ended (those in `may_hang` not waited for once the others
    ended: a frozen process) or `timeout` passed; the rest is then killed
    and has returncode None."""
    envs = workers.jax_cluster_envs(num_processes)
    for env in envs:
        env["XLA_FLAGS"] = workers._with_device_count(
            os.environ.get("XLA_FLAGS", ""), cpu_devices
        )
    with workers.started_processes(
        target, envs, args, None, cpu_devices, "jax", timeout
    ) as (workdir, procs, logs):
        ended: list[float | None] = [None] * len(procs)
        deadline = time.monotonic() + timeout
        awaited = [i for i in range(len(procs)) if i not in may_hang]
        while time.monotonic() < deadline:
            if all(ended[i] is not None for i in awaited):
                break
            for index, proc in enumerate(procs):
                if ended[index] is None and proc.poll() is not None:
                    ended[index] = time.time()
            time.sleep(0.02)
        outputs = workers._outputs(logs)
        results = []
        for index, proc in enumerate(procs):
            path = os.path.join(workdir, f"result_{index}.pkl")
            result = None
            if os.path.exists(path):
                with open(path, "rb") as f:
                    result = pickle.load(f)
            results.append(
                {
                    "returncode": proc.returncode if ended[index] else None,
                    "ended_at": ended[index],
                    "output": outputs[index],
                    "result": result,
                }
            )
        return results

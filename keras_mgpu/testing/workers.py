"""Run a function in the processes of a multi-worker cluster on 127.0.0.1."""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

_LIVE: set[subprocess.Popen] = set()
_LIVE_LOCK = threading.Lock()


class WorkersFailed(RuntimeError):
    """A worker process raised, exited abnormally or ran out of time.

    The message holds the end of every worker's output; `outputs` holds
    each one's whole output, by position.
    """

    def __init__(self, message: str, outputs: list[str]) -> None:
        super().__init__(message)
        self.outputs = outputs


def free_ports(count: int) -> list[int]:
    """`count` distinct free TCP ports on 127.0.0.1."""
    sockets, ports = [], []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in sockets:
            s.close()
    return ports


def cluster_tf_configs(
    num_workers: int, chief: bool = False
) -> list[dict[str, Any]]:
    """One `TF_CONFIG` per process of a cluster on 127.0.0.1 with free
    ports: `num_workers` collective members, the first being `chief:0` when
    `chief`, else `worker:0`."""
    tasks = [("chief", 0)] if chief else []
    tasks += [("worker", i) for i in range(num_workers - len(tasks))]
    ports = iter(free_ports(len(tasks)))
    cluster: dict[str, list[str]] = {}
    for task_type, _ in tasks:
        cluster.setdefault(task_type, []).append(f"127.0.0.1:{next(ports)}")
    return [
        {"cluster": cluster, "task": {"type": t, "index": i}} for t, i in tasks
    ]


def _target_of(fn: Callable | str) -> str:
    if isinstance(fn, str):
        if ":" not in fn:
            raise ValueError(
                "Argument `fn` must be an importable function or a "
                f"'module:function' string. Received: fn={fn!r}"
            )
        return fn
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", "")
    if not callable(fn) or not module or "<" in name or module == "__main__":
        raise ValueError(
            "Argument `fn` must be a function defined at the top level of an "
            "importable module (each worker imports it in a new process). "
            f"Received: fn={fn!r}"
        )
    return f"{module}:{name}"


def run_workers(
    fn: Callable | str,
    num_workers: int = 2,
    *args: Any,
    timeout: float = 120.0,
    chief: bool = False,
    env: dict[str, str] | None = None,
    cpu_devices: int = 1,
) -> list[Any]:
    """Call `fn(*args)` in `num_workers` real processes forming a
    `MultiWorkerMirroredStrategy` cluster on 127.0.0.1; return their results.

    Each process gets its own `TF_CONFIG` (worker-only, or `chief:0` plus
    workers with `chief=True`), the parent's `sys.path` (so test modules
    import) and `cpu_devices` logical CPU devices, then imports `fn` and
    calls it; `fn` builds its strategy
    (`tf.distribute.MultiWorkerMirroredStrategy()`) and returns something
    picklable. Results come back in task order. Every process runs in a
    process group of its own, killed when the call returns, raises, times
    out or is interrupted: nothing is left behind.

    Args:
        fn: an importable top-level function, or "module:function".
        num_workers: int >= 1, collective members (the chief included).
        *args: picklable arguments passed to `fn` in every process.
        timeout: float > 0, seconds for the whole cluster.
        chief: bool, make the first process `chief:0` (Kubeflow's TFJob
            shape) instead of `worker:0`. Defaults to False.
        env: extra environment variables for the processes.
        cpu_devices: int >= 1, logical CPU devices per process.

    Returns:
        A list with each process's return value.

    TensorFlow only for now: on JAX it raises `BackendNotSupportedError`
    (clusters of JAX processes, `keras.distribution.initialize()`, are a
    later issue).

    Raises:
        WorkersFailed: a process raised or died (its output and traceback
            in the message), or the cluster did not finish in `timeout`.
        BackendNotSupportedError: on the JAX backend.

    Example:

    ```python
    def train(scale):   # at the top level of a test module
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        ...
        return float(loss)

    losses = keras_mgpu.testing.run_workers(train, 2, 0.5, timeout=60)
    ```
    """
    _refuse_off_tensorflow()
    target = _target_of(fn)
    for name, value, low in (
        ("num_workers", num_workers, 1),
        ("cpu_devices", cpu_devices, 1),
    ):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(
                f"Argument `{name}` must be an integer >= {low}. "
                f"Received: {name}={value!r}"
            )
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(
            f"Argument `timeout` must be a number > 0. Received: "
            f"timeout={timeout!r}"
        )
    configs = cluster_tf_configs(num_workers, chief)
    workdir = tempfile.mkdtemp(prefix="keras_mgpu_workers_")
    with open(os.path.join(workdir, "args.pkl"), "wb") as f:
        pickle.dump(args, f)
    procs, logs = [], []
    try:
        for index, config in enumerate(configs):
            log = open(os.path.join(workdir, f"log_{index}.txt"), "w+")
            logs.append(log)
            procs.append(
                _start(target, workdir, index, config, env, cpu_devices, log)
            )
        _wait(procs, logs, timeout, target)
        return [_result(workdir, i, logs) for i in range(len(procs))]
    finally:
        for proc in procs:
            _kill(proc)
        for log in logs:
            log.close()


def _refuse_off_tensorflow() -> None:
    from keras_mgpu.testing.strategies import running_backend

    if running_backend() != "tensorflow":
        from keras_mgpu.backend import ON_JAX_MULTI_PROCESS, require_backend

        require_backend(
            "keras_mgpu.testing.run_workers",
            ("tensorflow",),
            instead=(
                f"{ON_JAX_MULTI_PROCESS} (a multi-process test harness for "
                "JAX is planned, issue 29; in one process, the `strategy` "
                "fixture's data_parallel_<n> entries)"
            ),
        )


def _start(target, workdir, index, config, env, cpu_devices, log):
    child_env = dict(os.environ)
    child_env.update(env or {})
    child_env["TF_CONFIG"] = json.dumps(config)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    spec = json.dumps(
        {
            "target": target,
            "workdir": workdir,
            "index": index,
            "cpu_devices": cpu_devices,
        }
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_mgpu.testing._child", spec],
        env=child_env,
        cwd=os.getcwd(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, killed as one
    )
    with _LIVE_LOCK:
        _LIVE.add(proc)
    return proc


def _wait(procs, logs, timeout, target) -> None:
    deadline = time.monotonic() + timeout
    pending = list(procs)
    while pending:
        for proc in list(pending):
            if proc.poll() is not None:
                pending.remove(proc)
                if proc.returncode != 0:
                    # One worker failed: its peers would wait for it in
                    # their next collective; stop them now.
                    raise WorkersFailed(
                        f"{target}: process {procs.index(proc)} exited with "
                        f"{proc.returncode}" + _tails(logs),
                        _outputs(logs),
                    )
        if pending and time.monotonic() > deadline:
            raise WorkersFailed(
                f"{target}: the cluster did not finish within {timeout:.0f} s "
                "(a hang, or a timeout too small for this machine)"
                + _tails(logs),
                _outputs(logs),
            )
        time.sleep(0.05)


def _result(workdir: str, index: int, logs) -> Any:
    path = os.path.join(workdir, f"result_{index}.pkl")
    if not os.path.exists(path):
        raise WorkersFailed(
            f"process {index} returned no result" + _tails(logs),
            _outputs(logs),
        )
    with open(path, "rb") as f:
        return pickle.load(f)


def _kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()
    with _LIVE_LOCK:
        _LIVE.discard(proc)


def kill_all() -> None:
    """Kill every worker process `run_workers` started and has not reaped
    (the plugin calls it at the end of the session)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
    for proc in live:
        _kill(proc)


def _outputs(logs) -> list[str]:
    texts = []
    for log in logs:
        log.flush()
        log.seek(0)
        texts.append(log.read())
    return texts


def _tails(logs) -> str:
    return "".join(
        f"\n--- worker process {i} output (end) ---\n{text[-3000:]}"
        for i, text in enumerate(_outputs(logs))
    )

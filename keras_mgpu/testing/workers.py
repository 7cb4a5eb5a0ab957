"""Run a function in the processes of a multi-worker cluster on 127.0.0.1."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

_LIVE: dict[subprocess.Popen, subprocess.Popen] = {}
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
    """Call `fn(*args)` in `num_workers` real processes forming a cluster on
    127.0.0.1; return their results.

    TensorFlow: a `MultiWorkerMirroredStrategy` cluster. Each process gets
    its own `TF_CONFIG` (worker-only, or `chief:0` plus workers with
    `chief=True`); `fn` builds its strategy
    (`tf.distribute.MultiWorkerMirroredStrategy()`).

    JAX (`KERAS_BACKEND=jax` in the caller): a `jax.distributed` cluster.
    Each process gets `KERAS_BACKEND=jax`, `cpu_devices` JAX CPU devices
    (`XLA_FLAGS`) and Keras's `KERAS_DISTRIBUTION_JOB_ADDRESSES` (process
    0's free port), `_NUM_PROCESSES` and `_PROCESS_ID`, and joins the
    cluster with `keras_mgpu.distribute.start_cluster` (gloo CPU
    collectives, waits bounded by `timeout`) before `fn` runs: `fn` builds
    its `keras.distribution.DataParallel(devices=jax.devices())` over
    every process's devices. `chief=True` is refused (process 0 is the
    coordinator).

    Every process also gets the parent's `sys.path` (so test modules
    import), imports `fn` and calls it; `fn` returns something picklable.
    Results come back in process order. Every process runs in a process
    group of its own, killed when the call returns, raises, times out or is
    interrupted, and its temporary folder deleted: nothing is left behind,
    also when the caller itself dies (SIGTERM, SIGKILL, `os._exit` from
    pytest-timeout's thread method): on Linux the workers get SIGKILL with
    their parent (`PR_SET_PDEATHSIG`), and a small reaper process that holds
    a pipe from the caller kills the process groups and deletes the folder
    when the pipe closes.

    Args:
        fn: an importable top-level function, or "module:function".
        num_workers: int >= 1, collective members (the chief included).
        *args: picklable arguments passed to `fn` in every process.
        timeout: float > 0, seconds for the whole cluster.
        chief: bool, make the first process `chief:0` (Kubeflow's TFJob
            shape) instead of `worker:0`. TensorFlow only. Defaults to
            False.
        env: extra environment variables for the processes.
        cpu_devices: int >= 1, CPU devices per process.

    Returns:
        A list with each process's return value.

    Raises:
        WorkersFailed: a process raised or died (its output and traceback
            in the message), or the cluster did not finish in `timeout`.
        ValueError: a bad argument.

    Example:

    ```python
    def train(scale):   # at the top level of a test module
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        # on JAX: keras.distribution.DataParallel(devices=jax.devices())
        ...
        return float(loss)

    losses = keras_mgpu.testing.run_workers(train, 2, 0.5, timeout=60)
    ```
    """
    backend = _worker_backend()
    target = _target_of(fn)
    _check_sizes(num_workers=num_workers, cpu_devices=cpu_devices)
    _check_timeout(timeout)
    if backend == "jax":
        if chief:
            raise ValueError(
                "Argument `chief` is for TensorFlow clusters (TF_CONFIG): a "
                "JAX cluster's process 0 is its coordinator. Received: "
                "chief=True with KERAS_BACKEND=jax"
            )
        envs = jax_cluster_envs(num_workers)
        for cluster_env in envs:
            cluster_env["XLA_FLAGS"] = with_device_count(
                (env or {}).get("XLA_FLAGS", os.environ.get("XLA_FLAGS", "")),
                cpu_devices,
            )
    else:
        envs = [
            {"TF_CONFIG": json.dumps(config)}
            for config in cluster_tf_configs(num_workers, chief)
        ]
    with started_processes(
        target, envs, args, env, cpu_devices, backend, timeout
    ) as (workdir, procs, logs):
        _wait(procs, logs, timeout, target)
        return [_result(workdir, i, logs) for i in range(len(procs))]


def run_jax_cluster(
    fn: Callable | str,
    num_processes: int,
    *args: Any,
    timeout: float,
    cpu_devices: int = 2,
    may_hang: tuple[int, ...] = (),
) -> list[dict[str, Any]]:
    """`run_workers` for tests of failures, on a JAX cluster whose
    processes may die (a watchdog ends them with status 75, JAX aborts
    them, a test SIGKILLs one): a failed process does not stop the others.

    Runs `fn(*args)` in every process of a fresh `jax.distributed` cluster
    on 127.0.0.1 (as `run_workers` does with `KERAS_BACKEND=jax`), waits
    until every process ended, those in `may_hang` not waited for once
    the others ended (a frozen process), or `timeout` passed; then kills
    what still runs and deletes the folder, as `run_workers` does.

    Args:
        fn: an importable top-level function, or "module:function".
        num_processes: int >= 1, processes in the cluster.
        *args: picklable arguments passed to `fn` in every process.
        timeout: float > 0, seconds for the whole cluster.
        cpu_devices: int >= 1, JAX CPU devices per process. Defaults to 2.
        may_hang: indices of processes not waited for once the others
            ended.

    Returns:
        One dict per process, in order: `returncode` (None: it was still
        running, then killed), `ended_at` (`time.time()` when it was seen
        to end, or None), `output` (its stdout and stderr) and `result`
        (what `fn` returned, None when it did not return).

    Example:

    ```python
    runs = run_jax_cluster("bodies:kill_one", 2, timeout=60, may_hang=(1,))
    assert runs[0]["returncode"] == 75  # the watchdog ended it
    ```
    """
    target = _target_of(fn)
    _check_sizes(num_processes=num_processes, cpu_devices=cpu_devices)
    _check_timeout(timeout)
    envs = jax_cluster_envs(num_processes)
    for env in envs:
        env["XLA_FLAGS"] = with_device_count(
            os.environ.get("XLA_FLAGS", ""), cpu_devices
        )
    with started_processes(
        target, envs, args, None, cpu_devices, "jax", timeout
    ) as (workdir, procs, logs):
        ended = _wait_for_ends(procs, timeout, may_hang)
        outputs = _outputs(logs)
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


def _wait_for_ends(procs, timeout, may_hang) -> list[float | None]:
    """Each process's end (`time.time()`), None for one still running
    when the others in `procs` but `may_hang` ended or `timeout` passed."""
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
    return ended


def _check_sizes(**sizes: Any) -> None:
    for name, value in sizes.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(
                f"Argument `{name}` must be an integer >= 1. "
                f"Received: {name}={value!r}"
            )


def _check_timeout(timeout: Any) -> None:
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(
            f"Argument `timeout` must be a number > 0. Received: "
            f"timeout={timeout!r}"
        )


@contextlib.contextmanager
def started_processes(
    target: str,
    envs: list[dict],
    args: tuple,
    env: dict | None,
    cpu_devices: int,
    backend: str,
    timeout: float,
) -> Iterator[tuple[str, list, list]]:
    """One process per entry of `envs` running `target(*args)` (the child
    entry point: joins the cluster, writes `result_<i>.pkl` in the work
    folder), each in its own process group, logging to `log_<i>.txt`;
    yields (work folder, processes, open logs). On exit every process
    still running is killed, the logs closed, the folder deleted, the
    reaper stopped: nothing is left behind, whatever the caller waited
    for (tests of failures wait for their own ends)."""
    workdir = tempfile.mkdtemp(prefix="keras_mgpu_workers_")
    reaper = _start_reaper(workdir)
    procs, logs = [], []
    try:
        with open(os.path.join(workdir, "args.pkl"), "wb") as f:
            pickle.dump(args, f)
        for index, cluster_env in enumerate(envs):
            log = open(os.path.join(workdir, f"log_{index}.txt"), "w+")
            logs.append(log)
            spec = {
                "target": target,
                "workdir": workdir,
                "index": index,
                "cpu_devices": cpu_devices,
                "backend": backend,
                "timeout": timeout,
            }
            procs.append(_start(spec, cluster_env, env, log, reaper))
        yield workdir, procs, logs
    finally:
        for proc in procs:
            _kill(proc, reaper)
        for log in logs:
            log.close()
        _stop_reaper(reaper, workdir)


def _worker_backend() -> str:
    from keras_mgpu.testing.strategies import running_backend

    return "jax" if running_backend() == "jax" else "tensorflow"


def jax_cluster_envs(num_processes: int) -> list[dict[str, str]]:
    """Keras's `KERAS_DISTRIBUTION_*` variables for each process of a JAX
    cluster on 127.0.0.1, process 0 (the coordinator) on a free port."""
    (port,) = free_ports(1)
    return [
        {
            "KERAS_BACKEND": "jax",
            "KERAS_DISTRIBUTION_JOB_ADDRESSES": f"127.0.0.1:{port}",
            "KERAS_DISTRIBUTION_NUM_PROCESSES": str(num_processes),
            "KERAS_DISTRIBUTION_PROCESS_ID": str(index),
        }
        for index in range(num_processes)
    ]


def with_device_count(flags: str, count: int) -> str:
    """`flags` (an `XLA_FLAGS` value) asking JAX for `count` CPU devices
    (`--xla_force_host_platform_device_count`, replacing any such flag)."""
    import re

    flag = "--xla_force_host_platform_device_count"
    flags = re.sub(rf"{flag}=\S+", "", flags).strip()
    return f"{flags} {flag}={count}".strip()


_CLUSTER_VARIABLES = (
    "TF_CONFIG",
    "KERAS_DISTRIBUTION_JOB_ADDRESSES",
    "KERAS_DISTRIBUTION_NUM_PROCESSES",
    "KERAS_DISTRIBUTION_PROCESS_ID",
)


def _start_reaper(workdir: str) -> subprocess.Popen:
    script = os.path.join(os.path.dirname(__file__), "_reaper.py")
    return subprocess.Popen(
        [sys.executable, "-I", script, workdir],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # a signal to our group must not reach it
    )


def _tell_reaper(reaper: subprocess.Popen, line: str) -> None:
    try:
        reaper.stdin.write(line + "\n")
        reaper.stdin.flush()
    except (BrokenPipeError, OSError, ValueError):
        pass


def _stop_reaper(reaper: subprocess.Popen, workdir: str) -> None:
    try:
        reaper.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    try:
        reaper.wait(timeout=30)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()
    shutil.rmtree(workdir, ignore_errors=True)


def _start(spec, cluster_env, env, log, reaper):
    child_env = dict(os.environ)
    for name in _CLUSTER_VARIABLES:
        child_env.pop(name, None)
    child_env.update(env or {})
    child_env.update(cluster_env)
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    child_env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    spec = dict(spec, parent=os.getpid())
    proc = subprocess.Popen(
        [sys.executable, "-m", "keras_mgpu.testing._child", json.dumps(spec)],
        env=child_env,
        cwd=os.getcwd(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # its own process group, killed as one
    )
    _tell_reaper(reaper, f"+{proc.pid}")
    with _LIVE_LOCK:
        _LIVE[proc] = reaper
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


def _kill(proc: subprocess.Popen, reaper: subprocess.Popen | None) -> None:
    # The whole group: whatever the worker started goes too. Only while
    # the group's leader is unreaped is its id certainly still ours.
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()
    if reaper is not None:
        _tell_reaper(reaper, f"-{proc.pid}")
    with _LIVE_LOCK:
        _LIVE.pop(proc, None)


def kill_all() -> None:
    """Kill every worker process `run_workers` started and has not reaped
    (the plugin calls it at the end of the session)."""
    with _LIVE_LOCK:
        live = list(_LIVE.items())
    for proc, reaper in live:
        _kill(proc, reaper)


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

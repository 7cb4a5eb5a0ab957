"""Run test bodies in separate processes: multi-worker clusters and the like.

`run_workers("module:function", num_workers=2)` starts that many real
worker processes on 127.0.0.1, each with its own `TF_CONFIG` and free port,
calls `function(task_index)` in each (the module is imported from `tests/`),
and returns what each returned (JSON-serialisable). Every process is bounded
by `timeout` seconds and is killed and reaped whatever happens, failure and
KeyboardInterrupt included.

`run_in_process("module:function", env=...)` does the same for one process
(a fresh TensorFlow runtime: default cross-device ops, in-process clusters).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from keras_mgpu.testing.workers import free_ports  # noqa: F401 (re-used)

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)


class ProcessFailure(RuntimeError):
    """A child process failed, timed out or returned nothing."""


def _child_env(extra: dict[str, str] | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TF_CONFIG", None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (TESTS_DIR, REPO_ROOT, env.get("PYTHONPATH")) if p
    )
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    # A native crash in a child shows its Python stack in the test output.
    env.setdefault("PYTHONFAULTHANDLER", "1")
    env["KERAS_MGPU_CHILD"] = "1"
    if extra:
        env.update(extra)
    return env


def _run_children(
    target: str,
    envs: list[dict[str, str]],
    timeout: float,
    args: tuple = (),
    may_die: tuple[int, ...] = (),
    stop_all_on_kill: bool = False,
) -> list[Any]:
    workdir = tempfile.mkdtemp(prefix="keras_mgpu_proc_")
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for index, env in enumerate(envs):
            result_path = os.path.join(workdir, f"result_{index}.json")
            log = open(os.path.join(workdir, f"log_{index}.txt"), "w+")
            logs.append(log)
            spec = json.dumps(
                {
                    "target": target,
                    "index": index,
                    "args": list(args),
                    "result_path": result_path,
                }
            )
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "_process_entry", spec],
                    env=env,
                    cwd=TESTS_DIR,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        deadline = time.monotonic() + timeout
        if stop_all_on_kill:
            may_die = tuple(range(len(procs)))
            _wait_or_stop_all(procs, deadline, target, timeout, logs)
        for proc in procs:
            remaining = max(deadline - time.monotonic(), 0.1)
            try:
                proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired as exc:
                raise ProcessFailure(
                    f"{target} did not finish within {timeout:.0f}s"
                    + _tails(logs)
                ) from exc
        failed = [
            i
            for i, p in enumerate(procs)
            if p.returncode != 0 and i not in may_die
        ]
        if failed:
            raise ProcessFailure(
                f"{target}: process(es) {failed} exited with "
                f"{[procs[i].returncode for i in failed]}" + _tails(logs)
            )
        results = []
        for index in range(len(envs)):
            path = os.path.join(workdir, f"result_{index}.json")
            if index in may_die and procs[index].returncode != 0:
                results.append(None)
                continue
            if not os.path.exists(path):
                raise ProcessFailure(
                    f"{target}: process {index} wrote no result" + _tails(logs)
                )
            with open(path) as f:
                results.append(json.load(f))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()
        for log in logs:
            log.close()


def _wait_or_stop_all(procs, deadline, target, timeout, logs) -> None:
    """Wait for every process; once one dies of a signal, SIGKILL the
    others (a job scheduler restarting the whole job)."""
    while any(p.poll() is None for p in procs):
        if any(p.returncode is not None and p.returncode < 0 for p in procs):
            for proc in procs:
                if proc.poll() is None:
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait()
            return
        if time.monotonic() > deadline:
            raise ProcessFailure(
                f"{target} did not finish within {timeout:.0f}s" + _tails(logs)
            )
        time.sleep(0.05)


def _tails(logs) -> str:
    out = []
    for index, log in enumerate(logs):
        log.flush()
        log.seek(0)
        text = log.read()[-3000:]
        out.append(f"\n--- process {index} output (tail) ---\n{text}")
    return "".join(out)


def cluster_tasks(
    num_workers: int, chief: bool = False, evaluator: bool = False
) -> list[tuple[str, int]]:
    """The `(task type, index)` of each process of a test cluster, in the
    order the processes are started (and results returned): the chief (if
    any), the workers, the evaluator (if any). `num_workers` counts the
    collective members, the chief included."""
    tasks = [("chief", 0)] if chief else []
    tasks += [("worker", i) for i in range(num_workers - len(tasks))]
    if evaluator:
        tasks.append(("evaluator", 0))
    return tasks


def run_workers(
    target: str,
    num_workers: int = 2,
    timeout: float = 180.0,
    args: tuple = (),
    env: dict[str, str] | None = None,
    may_die: tuple[int, ...] = (),
    chief: bool = False,
    evaluator: bool = False,
    stop_all_on_kill: bool = False,
) -> list[Any]:
    """Run `target` in the processes of a MultiWorkerMirrored cluster on
    127.0.0.1: `num_workers` collective members (worker-only, or
    `chief=True`: `chief:0` plus `worker:0..n-2`, as Kubeflow's TFJob and
    TensorFlow's guides write it), plus an `evaluator:0` task that is not a
    collective member when `evaluator=True`. `target(position, *args)` runs
    in each, `position` being its place in `cluster_tasks(...)`.

    Processes listed in `may_die` may exit abnormally (a test kills them):
    their result is then None instead of a failure. `stop_all_on_kill=True`:
    once a process dies of a signal, the others are SIGKILLed at once (as a
    scheduler restarting the whole job would) and any process may die.
    """
    tasks = cluster_tasks(num_workers, chief, evaluator)
    ports = iter(free_ports(len(tasks)))
    cluster: dict[str, list[str]] = {}
    for task_type, _ in tasks:
        cluster.setdefault(task_type, []).append(f"127.0.0.1:{next(ports)}")
    envs = []
    for task_type, index in tasks:
        tf_config = {
            "cluster": cluster,
            "task": {"type": task_type, "index": index},
        }
        envs.append(
            _child_env({**(env or {}), "TF_CONFIG": json.dumps(tf_config)})
        )
    return _run_children(target, envs, timeout, args, may_die, stop_all_on_kill)


def run_in_process(
    target: str,
    timeout: float = 180.0,
    args: tuple = (),
    env: dict[str, str] | None = None,
    may_die: bool = False,
) -> Any:
    """Run `target(0, *args)` in one fresh Python process; return its result
    (None if `may_die` and it exited abnormally)."""
    return _run_children(
        target, [_child_env(env)], timeout, args, (0,) if may_die else ()
    )[0]

"""`run_workers` leaves nothing behind when pytest itself dies (issue 31
item 6): a pytest run whose test is inside `run_workers` is ended by
SIGTERM, or by pytest-timeout's thread method (`os._exit`); afterwards no
worker process and no `keras_mgpu_workers_*` folder may remain.

The inner runs use the JAX backend (its workers start fastest); the
clean-up does not depend on the backend. Processes are found by their
command line, which holds the run's private temporary folder, so the check
holds whatever stage the workers had reached.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.slow

REPO_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
)
INNER_BACKEND = os.environ.get("KERAS_MGPU_INNER_BACKEND", "jax")

BODIES = """
import os, time

def sleep(piddir):
    with open(os.path.join(piddir, f"{os.getpid()}.pid"), "w") as f:
        f.write("started")
    time.sleep(600)
"""

INNER_TEST = """
import os
from keras_mgpu.testing import run_workers

def test_cluster():
    run_workers("orphan_bodies:sleep", 2, os.environ["PIDDIR"], timeout=600)
"""


def _processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().decode(errors="replace")
            with open(f"/proc/{entry}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry))
    return found


def _start_inner(root, *args):
    (root / "orphan_bodies.py").write_text(BODIES)
    (root / "test_inner.py").write_text(INNER_TEST)
    tmp = root / "tmp"
    piddir = root / "pids"
    tmp.mkdir()
    piddir.mkdir()
    env = dict(os.environ)
    env.update(
        TMPDIR=str(tmp),
        PIDDIR=str(piddir),
        KERAS_BACKEND=INNER_BACKEND,
        PYTHONPATH=os.pathsep.join(p for p in [str(root), *sys.path] if p),
    )
    env.pop("PYTEST_ADDOPTS", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
        + list(args)
        + ["test_inner.py"],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    return proc, tmp, piddir


def _wait_for_workers(proc, piddir, limit=180.0):
    deadline = time.monotonic() + limit
    while len(os.listdir(piddir)) < 2:
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("the workers did not start:\n" + proc.stdout.read())
        time.sleep(0.2)


def _assert_nothing_left(tmp, piddir, limit=30.0):
    pids = [int(name.split(".")[0]) for name in os.listdir(piddir)]
    assert len(pids) == 2
    deadline = time.monotonic() + limit
    while True:
        # A worker SIGKILLed a moment ago can still be exiting (state R
        # while the kernel frees a JAX process's memory; CI saw one just
        # after the reaper deleted the folder): wait for it, within limit.
        alive = _processes_mentioning(str(tmp)) + [
            pid
            for pid in pids
            if os.path.exists(f"/proc/{pid}") and not _is_zombie(pid)
        ]
        folders = [n for n in os.listdir(tmp) if "keras_mgpu_workers_" in n]
        if not alive and not folders:
            break
        if time.monotonic() > deadline:
            described = [_describe(pid) for pid in alive]
            for pid in alive:  # clean up before failing
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            pytest.fail(
                f"left behind: processes {described}, folders {folders}"
            )
        time.sleep(0.2)


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError as error:
        return f"process {pid}: {error}"
    return f"process {pid} still runs: {cmdline[:300]} | {stat[:120]}"


def _is_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_sigterm_to_pytest_leaves_no_worker_and_no_folder(tmp_path):
    proc, tmp, piddir = _start_inner(tmp_path)
    _wait_for_workers(proc, piddir)
    os.kill(proc.pid, signal.SIGTERM)
    proc.wait(timeout=60)
    _assert_nothing_left(tmp, piddir)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_pytest_timeout_thread_method_leaves_no_worker_and_no_folder(
    tmp_path,
):
    pytest.importorskip("pytest_timeout")
    proc, tmp, piddir = _start_inner(
        tmp_path,
        "--timeout=30",
        "--timeout-method=thread",
    )
    _wait_for_workers(proc, piddir)
    output, _ = proc.communicate(timeout=120)
    assert "Timeout" in output, output
    _assert_nothing_left(tmp, piddir)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_processes": 0}, r"`num_processes` must be an integer >= 1\. "),
        ({"cpu_devices": True}, r"Received: cpu_devices=True"),
        ({"timeout": 0}, r"`timeout` must be a number > 0\. Received: "),
    ],
)
def test_run_jax_cluster_refuses_bad_arguments_before_starting(kwargs, match):
    from keras_mgpu.testing.workers import run_jax_cluster

    arguments = {"num_processes": 2, "timeout": 10, **kwargs}
    with pytest.raises(ValueError, match=match):
        run_jax_cluster("os:getpid", **arguments)

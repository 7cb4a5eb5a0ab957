"""The kill / stall and restart scenario shared by both flavours' tests."""

from __future__ import annotations

import os
import re

from _processes import run_workers
from distribute import mw_backup_bodies as bodies

BODY = "distribute.mw_backup_bodies:train"


def interrupted_then_resumed(tmp_dir: str, mode: str) -> dict:
    """Run the job with worker 1 killed or stalled, then restart it whole.

    Returns the survivor's result of the first run, the backup files, both
    workers' results of the restart and the uninterrupted reference
    (computed in this process, without a strategy).
    """
    backup = os.path.join(tmp_dir, "backup")
    first = run_workers(BODY, 2, timeout=240, args=(backup, mode), may_die=(1,))
    backup_files = sorted(os.listdir(backup)) if os.path.isdir(backup) else []
    restarted = run_workers(BODY, 2, timeout=240, args=(backup, "none"))
    return {
        "first": first,
        "backup_files": backup_files,
        "restarted": restarted,
        "reference": bodies.uninterrupted(0),
        "backup_left": os.path.exists(backup),
    }


def names_worker_1(error: str) -> bool:
    """The watchdog's message names task worker:1 as TF_CONFIG does, with
    its address."""
    return "worker:1 (127.0.0.1:" in error


def names_task(error: str, task_type: str = "worker", index: int = 1) -> bool:
    """Whether `error` names the task `task_type:index` in any form: ours
    ("worker:1 (127.0.0.1:port)") or TensorFlow's job path
    ("/job:worker/replica:0/task:1")."""
    return bool(
        re.search(
            rf"(?<![\w/]){task_type}:{index}(?!\d)"
            rf"|/job:{task_type}/replica:\d+/task:{index}(?!\d)",
            error,
        )
    )


def assert_names_the_killed_worker(error: str) -> None:
    """The survivor's error names the killed task (worker:1), whichever
    detector wins the race: WorkerWatchdog's stale heartbeat, TensorFlow's
    peer health check ("task:1 is down"), the collective in flight whose
    gRPC call fails ("Socket closed" from remote target task:1), the
    coordination service ("tasks are unhealthy (stopped sending
    heartbeats): /job:worker/replica:0/task:1"), or any later one. The
    property is checked, not a list of messages: the survivor failed, and
    its error names the dead task. (The stall test, where no socket closes,
    needs the watchdog and checks it.)"""
    assert error, "the survivor did not fail"
    assert names_task(error, "worker", 1), error
